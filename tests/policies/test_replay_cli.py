"""``specsched-replay``: the table, the charts, and one-line errors for logs it cannot read."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import sqlite_utils

from specsched.daemon.log import LogConfig, LogWriter
from specsched.engine.records import StepRecord, StepRequestRecord
from specsched.policies.replay_cli import COLUMNS, ReplayConfig, main, rewrite_args

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_log(path, num_requests: int = 3, length: int = 12) -> str:
    """A small but real log: draft proposer, fixed k=2, a repeating accept pattern, two scorers."""
    config = {
        "proposer": {"name": "draft", "max_k": 4},
        "scorer": {"names": ["batch_expansion", "mqa"]},
        "scheduler": {"max_num_seqs": 2},
        "cache": {"block_size": 4},
        "policy": {"name": "fixed", "k": 2, "scorer": "mqa"},
    }
    with LogWriter(LogConfig(path=str(path), flush_interval_s=0.05)) as log:
        log.start_run(config, model="hand", device="cpu", version="test")
        log.write_step(StepRecord(0, "prefill", 1.0, num_requests, 8 * num_requests, total_ms=4.0))
        step, pos, waiting, live = 1, {}, [f"r{i}" for i in range(num_requests)], []
        while waiting or live:
            while waiting and len(live) < 2:
                live.append(waiting.pop(0))
                pos[live[-1]] = 0
            rows = []
            for rid in live:
                k = min(2, length - pos[rid] - 2)
                a = min(k, (pos[rid] + step) % 3)
                rows.append(StepRequestRecord(rid, 8 + pos[rid], k, a, "1" * a + ("0" if a < k else "")))
                pos[rid] += a + 1
            scorer = "mqa" if step % 4 else "batch_expansion"
            ms = 2.0 + sum(q.k + 1 for q in rows) * (0.5 if scorer == "mqa" else 0.7)
            log.write_step(
                StepRecord(
                    step,
                    "decode",
                    1.0 + step,
                    len(rows),
                    sum(q.k + 1 for q in rows),
                    scorer,
                    "fixed",
                    "draft",
                    predicted_ms=ms * 1.1,
                    propose_ms=1.0,
                    score_ms=ms,
                    verify_ms=0.2,
                    total_ms=ms + 1.5,
                    num_emitted=sum(q.num_accepted + 1 for q in rows),
                    requests=rows,
                )  # fmt: skip
            )
            step += 1
            live = [r for r in live if pos[r] < length - 1]
        for i in range(num_requests):
            log.write_request(
                f"r{i}", client=None, arrival=1.0, first_token_time=1.0, finish_time=1e9, prompt_tokens=8,
                output_tokens=length, finish_reason="length", proposed=0, accepted=0,
            )  # fmt: skip
    return str(path)


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """The console script's entry point in a fresh interpreter (as `specsched-replay` runs it)."""
    code = (
        "import sys; from specsched.policies.replay_cli import main; sys.argv[0] = 'specsched-replay'; main()"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def run_main(monkeypatch, *args) -> str | int | None:
    """``main()`` in process (quicker than a subprocess); returns the exit code or message."""
    monkeypatch.setattr(sys, "argv", ["specsched-replay", *args])
    try:
        main()
    except SystemExit as e:
        return e.code
    return 0


def assert_one_line_error(code, *needles: str) -> None:
    if isinstance(code, subprocess.CompletedProcess):  # a real process: status 1, the message on stderr
        assert code.returncode == 1, code.stdout
        assert "Traceback" not in code.stderr
        code = code.stderr.strip()
    assert isinstance(code, str) and len(code.splitlines()) == 1, code  # sys.exit(message): status 1
    assert code.startswith("specsched-replay: ")
    for n in needles:
        assert n in code, code


@pytest.fixture(scope="module")
def log_path(tmp_path_factory) -> str:
    return make_log(tmp_path_factory.mktemp("replay-cli") / "run.sqlite")


def test_table_compares_recorded_and_named_policies(log_path, tmp_path):
    proc = cli(
        f"db={log_path}", "policy=fixed,goodput", "policy.fixed.k=1", "--plot", f"out={tmp_path}/charts"
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("policy "))
    assert all(c in lines[header] for c in COLUMNS)
    rows = lines[header + 1 : header + 5]
    assert [re.split(r"\s{2,}", r)[:2] for r in rows] == [
        ["fixed k=2", "recorded"],
        ["fixed k=2", "replayed"],
        ["fixed k=1", "replayed"],
        ["goodput", "replayed"],
    ]
    # the recorded row has measured ms; the replayed rows do not
    assert rows[0].split()[-3] != "-" and rows[2].split()[-3] == "-"
    assert any(line.startswith("- match bits:") for line in lines)
    for name in ("k_over_time.png", "scorer_vs_batch.png", "predicted_vs_measured.png"):
        path = tmp_path / "charts" / name
        assert path.stat().st_size > 1000
        assert path.read_bytes()[:8] == PNG_MAGIC
    assert not os.path.exists(tmp_path / "outputs")  # hydra writes nothing of its own


def test_default_is_every_builtin_policy(log_path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_main(monkeypatch, f"db={log_path}", "plot=true") == 0
    out = capsys.readouterr().out
    for name in ("threshold", "disable_by_batch", "hf_heuristic", "goodput"):
        assert any(line.startswith(name) for line in out.splitlines()), name
    assert sorted(os.listdir(tmp_path / "replay")) == sorted(
        ["k_over_time.png", "scorer_vs_batch.png", "predicted_vs_measured.png"]
    )


def test_logs_it_cannot_replay_fail_with_one_line(log_path, tmp_path, monkeypatch):
    other = tmp_path / "other_version.sqlite"
    shutil.copy(log_path, other)
    db = sqlite_utils.Database(other)
    db.execute("PRAGMA user_version = 7")  # a version this specsched cannot read
    db.close()
    assert_one_line_error(cli(f"db={other}"), "schema version 7")  # also as a real process

    run_row = tmp_path / "other_run.sqlite"
    shutil.copy(log_path, run_row)
    db = sqlite_utils.Database(run_row)
    db.execute("update runs set schema_version = 99")
    db.conn.commit()
    db.close()
    assert_one_line_error(run_main(monkeypatch, f"db={run_row}"), "run 1", "schema version 99")

    damaged = tmp_path / "damaged.sqlite"
    data = bytearray(open(log_path, "rb").read())
    data[4096 * 2 : 4096 * 3] = b"\x07" * 4096  # a page of the tables overwritten
    damaged.write_bytes(bytes(data))
    assert_one_line_error(run_main(monkeypatch, f"db={damaged}"), "damaged.sqlite", "malformed")

    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(os.urandom(5000))
    assert_one_line_error(run_main(monkeypatch, f"db={junk}"), "not a readable SQLite file")

    assert_one_line_error(run_main(monkeypatch, f"db={tmp_path}/missing.sqlite"), "no such log file")
    assert_one_line_error(
        run_main(monkeypatch, f"db={log_path}", "run_id=4"), "no run 4; runs in this log: 1"
    )
    assert_one_line_error(run_main(monkeypatch, f"db={log_path}", "policy=nope"), "unknown policy 'nope'")
    assert_one_line_error(run_main(monkeypatch, f"db={log_path}", "policy.k=3"), "policy=<name>")
    assert_one_line_error(run_main(monkeypatch), "missing db")


def test_rewrite_args_and_config_validation():
    assert rewrite_args(["policy.k=2", "+policy.x.y=[1,2]", "--plot", "policy=a,b", "policy=[c]"]) == [
        "++policy_options.k=2",
        "++policy_options.x.y=[1,2]",
        "plot=true",
        "policy=[a,b]",
        "policy=[c]",
    ]
    # policy.<option> goes to every named policy, policy.<name>.<option> to that one
    options = {"fixed": {"k": 1}, "scorer": "mqa"}
    cfg = ReplayConfig(db="x", policy=["fixed", "disable_by_batch"], policy_options=options)
    assert cfg.policy_configs() == [
        {"name": "fixed", "scorer": "mqa", "k": 1},
        {"name": "disable_by_batch", "scorer": "mqa"},
    ]
    assert ReplayConfig(db="x", policy="my.mod.Cls").policy_configs() == [{"_target_": "my.mod.Cls"}]
    assert ReplayConfig(db="x").policy_configs() is None
    with pytest.raises(ValueError, match="run_id must be >= 1"):
        ReplayConfig(db="x", run_id=0)
    with pytest.raises(ValueError, match="need the policy they are for"):
        ReplayConfig(db="x", policy_options={"k": 2})


def test_by_concurrency_prints_a_row_per_level_and_policy(log_path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_main(monkeypatch, f"db={log_path}", "by_concurrency=true", "policy=goodput") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["N", "segments", "requests", "policy"]
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]
    want = [["fixed k=2", "recorded"], ["fixed k=2", "replayed"], ["goodput", "replayed"]]
    assert [r[3:5] for r in rows[:3]] == want
