"""bench=serve on CPU: real daemons (subprocesses) on the tiny HF checkpoint with its chat template,
driven by concurrent protocol clients; a config that cannot start is reported and the rest run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import specsched.bench.cli as cli
from specsched.bench.serve import same_output_share
from specsched.bench.serve_config import ServeConfig
from specsched.bench.serve_host import PHASES
from specsched.bench.serve_load import PassResult, RequestResult, summarize

CONF_DIR = str(Path(cli.__file__).parent / "conf")
CONFIGS = [
    {"name": "non-speculative", "kind": "baseline",
     "overrides": ["proposer=none", "policy=fixed", "policy.k=0", "policy.scorer=batch_expansion"]},
    {"name": "broken", "kind": "policy", "overrides": ["proposer.max_k=-1"]},  # exits at config check
    {"name": "ngram k=2 MQA", "kind": "fixed",
     "overrides": ["proposer=ngram", "policy=fixed", "policy.k=2", "policy.scorer=mqa"]},
]  # fmt: skip


def serve_cfg(tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("bench", overrides=["bench=serve_tiny", f"bench.out_dir={tmp_path}", *overrides]).bench
    cfg.serve.configs = OmegaConf.create(CONFIGS)
    return cfg


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_serve_bench_tiny_hf_chat(tmp_path, tiny_hf_dir):
    cfg = serve_cfg(
        tmp_path,
        f"bench.serve.source={tiny_hf_dir}",
        "bench.serve.prompts=chat",
        "bench.serve.prompt_indices=[2,4,6,7]",  # the short prompts: the tiny model's context is 256
        f"bench.serve.log_dir={tmp_path / 'dblogs'}",
    )
    res = cli.run_bench(cfg, "test")
    assert res["errors"] == {}
    serve = res["serve"]
    info = {c["name"]: c for c in serve["configs"]}
    assert [c["name"] for c in serve["configs"]] == ["non-speculative", "broken", "ngram k=2 MQA"]
    broken = info.pop("broken")
    assert broken["startup_s"] is None and "exited with status" in broken["error"]
    assert "proposer.max_k" in broken["error"]  # the daemon's own message, from its log's tail
    for c in info.values():
        assert c["error"] is None and c["exit_status"] == 0 and c["startup_s"] > 0
        assert Path(c["daemon_log"]).read_text().count("listening on") == 1
    for c in serve["configs"]:
        assert pid_gone(c["pid"]), f"daemon of {c['name']} still runs"
    rows = serve["rows"]
    assert {r["config"] for r in rows} == set(info)
    for name in info:
        mine = [r for r in rows if r["config"] == name]
        assert sorted((r["concurrency"], r["pass"]) for r in mine) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r in rows:
        assert r["num_requests"] == 6 and r["num_errors"] == 0 and r["error"] is None
        assert 0 < r["output_tokens"] <= 6 * 8 and r["tokens_per_s"] > 0
        assert r["same_output"] == 1.0  # float32 on CPU: speculation is exactly lossless
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["ttft_max_s"] <= r["wall_s"]
        assert (r["spread"] is None) == (r["pass"] == 1)
    ngram = [r for r in rows if r["config"] == "ngram k=2 MQA"]
    assert all(r["tokens_per_step"] >= 1 for r in ngram)
    # host ms per phase from each daemon's decision log: both working configs, at N = 1 at least
    host = {(h["config"], h["concurrency"]): h for h in serve["host_phases"]}
    assert {c for c, _ in host} == set(info) and all((c, 1) in host for c in info)
    for h in host.values():
        assert h["num_steps"] > 0 and h["gpu_idle_ms"] > 0 and h["between"] > 0  # the daemon's loop
        inside = sum(h[p] for p in PHASES if p != "between")  # medians of the parts: about the whole
        assert 0 < inside <= 1.5 * h["total_ms"]
    assert host[("ngram k=2 MQA", 1)]["view"] > 0
    text = (tmp_path / "tables.md").read_text()
    assert "### Serving benchmark (bench=serve)" in text and "exited with status" in text
    assert "Host ms per decode step by phase" in text
    assert json.loads((tmp_path / "results.json").read_text())["serve"]["rows"] == json.loads(
        json.dumps(rows)
    )


def test_same_output_share_counts_mismatches():
    reqs = [RequestResult(0, [1, 2]), RequestResult(1, [3, 4]), RequestResult(0, [1, 5])]
    res = PassResult(1.0, reqs)
    assert same_output_share(res, {0: [1, 2], 1: [3, 4]}) == pytest.approx(2 / 3)
    assert same_output_share(res, None) is None
    reqs[1].error = "ConnectionLost: gone"  # failed requests are not compared
    assert same_output_share(res, {0: [1, 2], 1: [3, 4]}) == 0.5


def test_summarize_itl_is_per_token():
    r = RequestResult(0, [1, 2, 3, 4, 5], ttft_s=0.01, itl_s=[0.002] * 2 + [0.004] * 2)
    row = summarize(PassResult(0.5, [r]))
    assert row["tokens_per_s"] == 10 and row["itl_p50_ms"] == pytest.approx(3.0)
    assert row["ttft_p50_ms"] == pytest.approx(10.0) and row["compiles"] is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"configs": CONFIGS + [CONFIGS[0]]}, "names unique"),
        ({"configs": [CONFIGS[0], {**CONFIGS[0], "name": "b2"}]}, "at most one config of kind baseline"),
        ({"configs": [{"name": "x", "kind": "nope"}]}, "kind must be one of"),
        ({"configs": [{"name": "x", "overrides": ["daemon.endpoint=tcp://x:1"]}]}, "set by the bench"),
        ({"concurrency": []}, "concurrency"),
        ({"prompts": "chat", "oracle_override": "+proposer.oracle"}, "needs prompts=ids"),
    ],
)
def test_serve_config_rejects(change, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(**{"configs": CONFIGS, **change})


def test_timed_pass_counts_only_the_tokens_inside_its_window(tmp_path):
    """duration_s: a closed loop against a real daemon; tok/s is the window's tokens / window."""
    from specsched.bench.serve import Daemon
    from specsched.bench.serve_load import run_pass

    overrides = ["model.source=tiny", "model.device=cpu", "model.dtype=float32", "cache.num_blocks=256",
                 "proposer=none", "policy=fixed", "policy.k=0", "policy.scorer=batch_expansion",
                 "scorer=batch_expansion", "log=none"]  # fmt: skip
    daemon = Daemon(overrides, tmp_path / "d.log", {"OMP_NUM_THREADS": "1"})
    try:
        daemon.wait_ready(120)
        prompts = [{"prompt_ids": [5 + i, 7, 9, 11]} for i in range(3)]
        res = run_pass(daemon.endpoint, prompts, 1, 2, 16, 60, daemon.is_alive, duration_s=1.5)
    finally:
        daemon.stop(20)
    assert res.error is None and res.window_s == 1.5 and res.wall_s >= 1.5
    assert all(r.error is None for r in res.requests)
    assert len(res.requests) > 2  # both clients kept sending for the whole window (num_requests=1 unused)
    inside = sum(r.num_tokens_in_window for r in res.requests)
    total = sum(len(r.token_ids) for r in res.requests)
    assert 0 < inside < total  # the requests running at the window's end finished outside it
    assert summarize(res)["tokens_per_s"] == pytest.approx(inside / 1.5)
    assert [r.prompt_index for r in res.requests[:4]] == [0, 1, 2, 0]


def test_split_cpus_gives_daemons_and_clients_disjoint_halves(monkeypatch):
    from specsched.bench.serve import split_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    daemon, clients = split_cpus(True)
    assert daemon == set(range(8)) and clients == set(range(8, 16))
    assert split_cpus(False) == (None, None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert split_cpus(True) == (None, None)  # too few cores to split
