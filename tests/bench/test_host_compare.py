"""bench/host_compare.py on logs written by the real LogWriter: steps split by whether they decided
the next plan ahead, and each phase's mean difference against the reference log."""

from __future__ import annotations

import pytest

from specsched.bench.host_compare import compare, decode_groups, main
from specsched.daemon.log import LogConfig, LogWriter
from specsched.engine.records import StepRecord, StepRequestRecord


def write(path, steps: list[tuple[int, dict, dict]]) -> str:
    """A log of decode steps of batch 2: (step, host_ms, plan_info) each; total_ms 2.0."""
    with LogWriter(LogConfig(path=str(path), flush_interval_s=0.05)) as log:
        log.start_run({"policy": {"name": "x"}}, model="hand", device="cpu", version="test")
        for step, host, info in steps:
            reqs = [StepRequestRecord(f"r{i}", 10, 1, 1, "1") for i in range(2)]
            log.write_step(StepRecord(step, "decode", 1.0, 2, 4, "mqa", "x", "ngram", score_ms=1.0,
                                      total_ms=2.0, plan_info=info, host_ms=host, requests=reqs))  # fmt: skip
    return str(path)


def test_steps_before_a_fresh_plan_decided_ahead_are_their_own_group(tmp_path):
    ahead = {"is_planned_ahead": True, "plan_age": 0}
    carried = {"plan_age": 2}
    steps = [
        (0, {"overlap": 0.2, "other": 0.1}, {}),
        (1, {"overlap": 1.5, "other": 0.1}, carried),  # decides ahead: step 2 runs its plan
        (2, {"overlap": 0.2, "other": 0.3}, ahead),
        (3, {"overlap": 0.2, "other": 0.1, "between": 0.5}, carried),
    ]
    path = write(tmp_path / "a.sqlite", steps)
    groups = decode_groups(path, [2, 7])[2]
    assert len(groups["ahead"]) == 1 and len(groups["other"]) == 3
    assert groups["ahead"].phases["overlap"] == [1.5]
    assert groups["other"].step_ms == [2.0, 2.0, 2.5]  # total_ms + between
    assert not len(decode_groups(path, [7])[7]["other"])  # no step of batch 7


def test_the_delta_table_is_each_phase_s_mean_against_the_first_log(tmp_path, capsys):
    ref = write(tmp_path / "ref.sqlite", [(i, {"score": 0.5, "other": 0.1}, {}) for i in range(4)])
    cur = write(tmp_path / "cur.sqlite", [(i, {"score": 0.6, "other": 0.3}, {}) for i in range(4)])
    text = compare([ref, cur], [2])
    delta = [line for line in text.splitlines() if line.startswith("| cur | 2 | +")]  # the second table
    assert len(delta) == 1
    cells = [c.strip() for c in delta[0].strip("|").split("|")]
    header = [line for line in text.splitlines() if line.startswith("| log | batch | step |")][0]
    names = [c.strip() for c in header.strip("|").split("|")]
    by = dict(zip(names, cells))
    assert by["score"] == "+0.100" and by["other"] == "+0.200" and by["step"] == "+0.000"
    assert main([ref, cur, "--batch", "2", "--out", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text() == capsys.readouterr().out


def test_a_missing_log_names_itself(tmp_path):
    with pytest.raises(Exception, match="no such log file"):
        decode_groups(str(tmp_path / "none.sqlite"), [1])
