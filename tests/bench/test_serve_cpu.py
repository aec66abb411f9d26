"""bench=serve on CPU: real daemons (subprocesses) on the tiny HF checkpoint with its chat template,
driven by concurrent protocol clients; a config that cannot start is reported and the rest run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import specsched.bench.cli as cli
from specsched.bench.serve_config import ServeConfig
from specsched.bench.serve_host import PHASES
from specsched.bench.serve_outputs import same_output_share
from specsched.bench.serve_results import PassResult, RequestResult, summarize
from tests.daemon.test_affinity import fake_topology

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
        "bench.serve.duration_s=0.25",  # timed passes: staggered start, ramp, window; the baseline covers
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
    partial = json.loads((tmp_path / "serve_logs" / "partial.json").read_text())  # after the last config
    assert [c["name"] for c in partial["configs"]] == [c["name"] for c in serve["configs"]]
    assert len(partial["rows"]) == len(rows)
    for name in info:
        mine = [r for r in rows if r["config"] == name]
        assert sorted((r["concurrency"], r["pass"]) for r in mine) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r in rows:
        assert r["num_requests"] > r["requests_in_window"] > 0 and r["num_errors"] == 0 and r["error"] is None
        assert r["output_tokens"] > 0 and r["tokens_per_s"] > 0 and r["window_s"] == 0.25
        assert 0 < r["ramp_s"] < r["wall_s"] - 0.25
        # float32 on CPU: speculation is exactly lossless; every prompt has a full-length reference
        assert r["same_output"] == 1.0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["ttft_max_s"] <= r["wall_s"]
        assert (r["spread"] is None) == (r["pass"] == 1)
    ngram = [r for r in rows if r["config"] == "ngram k=2 MQA"]
    assert all(r["tokens_per_step"] >= 1 for r in ngram)
    # host ms per phase from each daemon's decision log: both working configs, at N = 1 at least
    host = {(h["config"], h["concurrency"]): h for h in serve["host_phases"]}
    assert {c for c, _ in host} == set(info) and all((c, 1) in host for c in info)
    for h in host.values():
        assert h["num_steps"] > 0 and h["gpu_idle_ms"] > 0 and h["between"] > 0  # the daemon's loop
        assert 0 < h["gpu_idle_per_forward_ms"] <= 4 * h["gpu_idle_ms"]  # a mean beside a median
        inside = sum(h[p] for p in PHASES if p != "between")  # medians of the parts: about the whole
        assert 0 < inside <= 1.5 * h["total_ms"]
        assert h["mean_ms"] > 0 and 0.0 <= h["slow_share"] < 0.5  # the tail beside the median
    assert host[("ngram k=2 MQA", 1)]["view"] > 0
    for c in info.values():  # where each daemon's time went, from its log
        mix = c["step_mix"]
        assert mix["num_decode_steps"] > 0 and mix["num_prefill_steps"] > 0 and 0 < mix["prefill_share"] < 1
        assert mix["prefill_score_ms"] > 0 and mix["decode_s"] > 0
        assert mix["decides_per_step"] == 1.0  # fixed k: never a carried plan
    text = (tmp_path / "tables.md").read_text()
    assert "### Serving benchmark (bench=serve)" in text and "exited with status" in text
    assert "Host ms per decode step by phase" in text and "Where each daemon's time went" in text
    # the kernel's counters of each daemon that served (daemon/host_stats.py), Linux
    hosts = [c for c in info.values() if c.get("host")]
    assert len(hosts) == (len(info) if os.path.isdir("/proc/self/task") else 0)
    for c in hosts:
        assert c["host"]["engine_voluntary_switches"] > 0 and c["host"]["num_threads"] >= 2
        assert f"| {c['name']} | " in text.split("The kernel's counters for each daemon")[1]
    assert "staggered start" in text and "then a 0.25 s window" in text
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
        ({"ramp_s": -1}, "ramp_s must be >= 0"),
        ({"interleave_s": 0.5}, r"interleave_s must be 0 or in \(0, duration_s = 0\]"),
        ({"interleave_s": 3, "duration_s": 2}, "interleave_s must be 0 or in"),
    ],
)
def test_serve_config_rejects(change, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(**{"configs": CONFIGS, **change})


@pytest.fixture(scope="module")
def tiny_daemon(tmp_path_factory):
    """One non-speculative daemon on the tiny preset (CPU, float32) for the timed-pass tests."""
    from specsched.bench.serve_daemon import Daemon

    overrides = ["model.source=tiny", "model.device=cpu", "model.dtype=float32", "cache.num_blocks=256",
                 "proposer=none", "policy=fixed", "policy.k=0", "policy.scorer=batch_expansion",
                 "scorer=batch_expansion", "log=none"]  # fmt: skip
    daemon = Daemon(overrides, tmp_path_factory.mktemp("daemon") / "d.log", {"OMP_NUM_THREADS": "1"})
    try:
        daemon.wait_ready(120)
        yield daemon
    finally:
        daemon.stop(20)


def id_prompts(n: int) -> list[dict]:
    return [{"prompt_ids": [5 + i, 7, 9, 11]} for i in range(n)]


def by_client(res) -> dict[int, list]:
    out: dict[int, list] = {}
    for r in sorted(res.requests, key=lambda r: (r.client, r.seq)):
        out.setdefault(r.client, []).append(r)
    return out


def test_timed_pass_staggers_the_first_requests(tiny_daemon):
    """Client c of N's first request has max_tokens ceil(M (c+1) / N) and they finish one after the
    other; every later request is a full one; the window opens when the last first request is done."""
    from specsched.bench.serve_load import run_pass, stagger_plan

    d = tiny_daemon
    res = run_pass(d.endpoint, id_prompts(3), 1, 4, 16, 60, d.is_alive, duration_s=0.5)
    assert res.error is None and all(r.error is None for r in res.requests)
    assert stagger_plan(16, 4) == [4, 8, 12, 16] and stagger_plan(128, 64)[:2] == [2, 4]
    assert stagger_plan(128, 1) == [128] and stagger_plan(128, 64)[-1] == 128
    mine = by_client(res)
    assert sorted(mine) == [0, 1, 2, 3]
    firsts = [mine[c][0] for c in range(4)]
    assert [r.max_tokens for r in firsts] == [4, 8, 12, 16]
    assert [len(r.token_ids) for r in firsts] == [4, 8, 12, 16]  # the tiny model: no early EOS here
    assert [r.staggered for r in firsts] == [True, True, True, False]
    ends = [r.chunk_at[-1] for r in firsts]
    assert ends == sorted(ends) and len(set(ends)) == 4  # spread out, in the clients' order
    assert all(r.max_tokens == 16 and not r.staggered for c in mine for r in mine[c][1:])
    assert all(len(mine[c]) >= 2 for c in mine)
    assert max(ends) <= res.opens_at <= max(ends) + 0.5  # ramp: until the last first request is done
    assert res.ramp_s == pytest.approx(res.opens_at - min(r.sent_at for r in firsts), abs=0.1)
    assert res.closes_at == pytest.approx(res.opens_at + 0.5)


def test_timed_pass_counts_only_the_tokens_inside_its_window(tiny_daemon):
    """tok/s = the tokens that arrived inside [opens_at, closes_at] / window: not the ramp's, not the
    drain's; TTFT and requests from the requests sent inside it."""
    from specsched.bench.serve_load import run_pass

    d = tiny_daemon
    res = run_pass(d.endpoint, id_prompts(3), 1, 2, 16, 60, d.is_alive, duration_s=0.6, ramp_s=0.2)
    assert res.error is None and res.window_s == 0.6 and res.wall_s >= 0.8
    assert all(r.error is None for r in res.requests)
    assert res.ramp_s >= 0.2 - 1e-6  # the floor: later than the first requests' end
    lo, hi = res.opens_at, res.closes_at
    at = [(t, n) for r in res.requests for t, n in zip(r.chunk_at, r.chunk_tokens)]
    before = sum(n for t, n in at if t < lo)
    inside = sum(n for t, n in at if lo <= t <= hi)
    after = sum(n for t, n in at if t > hi)
    assert before > 0 and after > 0 and inside > 0  # a ramp, a window, a drain
    assert sum(r.num_tokens_in_window for r in res.requests) == inside
    assert before + inside + after == sum(len(r.token_ids) for r in res.requests)
    row = summarize(res)
    assert row["tokens_per_s"] == pytest.approx(inside / 0.6) and row["ramp_s"] == res.ramp_s
    sent = [r for r in res.requests if lo <= r.sent_at < hi]
    assert row["requests_in_window"] == len(sent) > 0 and row["num_requests"] > len(sent)
    assert row["ttft_p50_ms"] == pytest.approx(np.percentile([r.ttft_s * 1e3 for r in sent], 50))
    itl = [x for r in res.requests for x in r.itl_between(lo, hi)]
    assert row["itl_p50_ms"] == pytest.approx(1e3 * float(np.percentile(itl, 50)))


def test_timed_pass_prompts_per_client_are_the_same_in_both_passes(tiny_daemon):
    """Client c of N sends prompts c, c+N, c+2N, ... mod the list, in every pass."""
    from specsched.bench.serve_load import client_prompts, run_pass

    d = tiny_daemon
    seqs = []
    for _ in range(2):
        res = run_pass(d.endpoint, id_prompts(4), 1, 3, 8, 60, d.is_alive, duration_s=0.3)
        assert res.error is None
        mine = by_client(res)
        assert sorted(mine) == [0, 1, 2]
        seq = {c: [r.prompt_index for r in rs] for c, rs in mine.items()}
        assert all(s == client_prompts(c, 3, 4, len(s)) for c, s in seq.items())
        assert all([r.seq for r in rs] == list(range(len(rs))) for rs in mine.values())
        seqs.append(seq)
    assert client_prompts(1, 3, 4, 5) == [1, 0, 3, 2, 1]
    for c in range(3):  # the same sequence, as far as both passes went
        k = min(len(seqs[0][c]), len(seqs[1][c]))
        assert k >= 2 and seqs[0][c][:k] == seqs[1][c][:k]


def test_timed_pass_cover_sends_every_prompt_of_each_client_at_full_length(tiny_daemon):
    """cover (the baseline's pass 1): after a window too short for it, each client goes on until its
    sequence's prompts all have a full-length output: the references of the later configs."""
    from specsched.bench.serve_load import cycle_length, run_pass
    from specsched.bench.serve_outputs import add_references

    d = tiny_daemon
    assert cycle_length(2, 5) == 5 and cycle_length(4, 8) == 2 and cycle_length(64, 8) == 1
    res = run_pass(d.endpoint, id_prompts(5), 1, 2, 8, 60, d.is_alive, duration_s=0.001, cover=True)
    assert res.error is None
    for rs in by_client(res).values():
        assert {r.prompt_index for r in rs if not r.staggered} == set(range(5))
        assert len(rs) <= cycle_length(2, 5) + 1
    assert any(r.sent_at >= res.closes_at for r in res.requests)  # sent after the window, to cover
    ref: dict[int, list[int]] = {}
    add_references(ref, res)
    assert sorted(ref) == list(range(5)) and all(len(v) == 8 for v in ref.values())  # none cut short


def test_timed_pass_over_processes_shares_one_window(tiny_daemon):
    """Clients dealt to 2 spawned processes: every client's sequence, the stagger, and one window for
    all, opened after the last first request of either process (one clock across processes)."""
    from specsched.bench.serve_load import client_prompts, run_pass, stagger_plan

    d = tiny_daemon
    res = run_pass(d.endpoint, id_prompts(3), 1, 4, 16, 60, d.is_alive, duration_s=0.5, procs=2)
    assert res.error is None and all(r.error is None for r in res.requests)
    mine = by_client(res)
    assert sorted(mine) == [0, 1, 2, 3]
    firsts = [mine[c][0] for c in range(4)]
    assert [r.max_tokens for r in firsts] == stagger_plan(16, 4)
    assert all([r.prompt_index for r in rs] == client_prompts(c, 4, 3, len(rs)) for c, rs in mine.items())
    assert max(r.chunk_at[-1] for r in firsts) <= res.opens_at  # both processes' first requests
    assert res.closes_at == pytest.approx(res.opens_at + 0.5)
    assert min(r.sent_at for r in res.requests) >= res.opens_at - res.ramp_s - 1e-6  # one t0
    lo, hi = res.opens_at, res.closes_at
    inside = sum(n for r in res.requests for t, n in zip(r.chunk_at, r.chunk_tokens) if lo <= t <= hi)
    assert inside > 0 and sum(r.num_tokens_in_window for r in res.requests) == inside
    assert {r.client % 2 for r in res.requests if r.sent_at >= lo} == {0, 1}  # both processes served


def test_counted_pass_over_processes_takes_each_request_once(tiny_daemon):
    """A counted pass over 3 processes: request i (prompt i mod 3) exactly once, in index order."""
    from specsched.bench.serve_load import load_procs, run_pass

    d = tiny_daemon
    res = run_pass(d.endpoint, id_prompts(3), 7, 3, 4, 60, d.is_alive, procs=3)
    assert res.error is None and len(res.requests) == 7
    assert [r.prompt_index for r in res.requests] == [i % 3 for i in range(7)]
    assert all(r.error is None and len(r.token_ids) == 4 for r in res.requests)
    assert load_procs(64, 0) == 1 and load_procs(1, 8) == 1 and 1 <= load_procs(64, 8) <= 8
    with pytest.raises(ValueError, match="clients_per_proc"):
        load_procs(4, -1)


def test_pass_over_processes_ends_when_the_daemon_exits(tiny_daemon):
    """is_alive turning false mid-pass stops every load process and names the cause; the processes
    are kept and serve the next pass."""
    import time

    from specsched.bench import serve_load
    from specsched.bench.serve_load import run_pass

    d = tiny_daemon
    stop_at = time.perf_counter() + 1.0
    res = run_pass(d.endpoint, id_prompts(3), 1, 2, 16, 60, lambda: time.perf_counter() < stop_at,
                   duration_s=30, procs=2)  # fmt: skip
    assert res.error == "the daemon exited during the pass"
    assert res.wall_s < 10 and len(res.requests) > 0
    pool = serve_load._kept
    again = run_pass(d.endpoint, id_prompts(3), 4, 2, 4, 60, d.is_alive, procs=2)  # the same processes
    assert again.error is None and len(again.requests) == 4 and serve_load._kept is pool


def test_cut_short_requests_are_neither_references_nor_compared():
    """same output: a timed pass's staggered (cut-short) first requests are left out of the share, and
    the baseline's never become references (its first full-length output per prompt does)."""
    from specsched.bench.serve_outputs import add_references

    short = RequestResult(0, [1, 2], max_tokens=2, staggered=True)
    full = [RequestResult(0, [1, 2, 3, 4], max_tokens=4), RequestResult(1, [5, 6, 7, 8], max_tokens=4)]
    ref: dict[int, list[int]] = {}
    add_references(ref, PassResult(1.0, [short, *full]))
    assert ref == {0: [1, 2, 3, 4], 1: [5, 6, 7, 8]}
    other = [RequestResult(0, [9], max_tokens=1, staggered=True),  # not a prefix: not counted either
             RequestResult(0, [1, 2, 3, 4], max_tokens=4),
             RequestResult(1, [5, 6, 0, 0], max_tokens=4)]  # fmt: skip
    assert same_output_share(PassResult(1.0, other), ref) == 0.5
    assert same_output_share(PassResult(1.0, other[:1]), ref) is None  # nothing to compare


def test_split_cpus_gives_daemons_and_clients_disjoint_halves(monkeypatch, tmp_path):
    from specsched.bench.serve_daemon import split_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    daemon, clients = split_cpus(True, str(tmp_path))  # no topology to read: halves of the CPUs
    assert daemon == set(range(8)) and clients == set(range(8, 16))
    assert split_cpus(False) == (None, None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert split_cpus(True) == (None, None)  # too few cores to split


def test_every_daemon_engine_thread_gets_the_same_cpu_of_the_daemon_half(monkeypatch, tmp_path):
    from specsched.bench.serve_daemon import Daemon, engine_cpu, split_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    daemon, _ = split_cpus(True, str(tmp_path))
    assert engine_cpu(daemon) == 7  # the highest daemon CPU, whatever the config
    assert engine_cpu(None) is None and engine_cpu({3}) is None
    started = []

    class Popen:  # what Daemon would launch: its argv and environment
        def __init__(self, argv, **kw):
            started.append((argv, kw["env"]))
            self.pid = 1

    monkeypatch.setattr("specsched.bench.serve_daemon.subprocess.Popen", Popen)
    for cpus in (daemon, None):
        Daemon(["model=tiny"], tmp_path / "d.log", {}, cpus)
    Daemon(["model=tiny", "daemon.engine_cpu=null"], tmp_path / "d.log", {}, daemon)  # its own choice
    (pinned, env), (unpinned, _), (own, _) = started
    assert "daemon.engine_cpu=7" in pinned and not any("engine_cpu" in a for a in unpinned)
    assert [a for a in own if "engine_cpu" in a] == ["daemon.engine_cpu=null"]
    assert env["PYTHONHASHSEED"] == "0"


def test_a_config_brings_its_own_environment_and_may_turn_its_log_off(tmp_path):
    from specsched.bench.serve_config import DaemonRun
    from specsched.bench.serve_daemon import daemon_env, daemon_overrides

    cfg = ServeConfig(
        configs=[
            {"name": "a", "env": {"OMP_NUM_THREADS": 1}},
            {"name": "b", "overrides": ["policy=goodput", "log=none"]},
        ],
        env={"X": "bench", "OMP_NUM_THREADS": "8"},
    )
    a, b = cfg.configs
    assert isinstance(a, DaemonRun) and a.env == {"OMP_NUM_THREADS": "1"}
    assert daemon_env(cfg, a) == {"X": "bench", "OMP_NUM_THREADS": "1"}  # the config's over the bench's
    assert daemon_env(cfg, b) == {"X": "bench", "OMP_NUM_THREADS": "8"}
    logs = tmp_path / "logs"
    assert daemon_overrides(cfg, a, logs)[-1] == f"log.path={logs / 'a.sqlite'}"
    over = daemon_overrides(cfg, b, logs)
    assert "log=none" in over and not any(o.startswith("log.path=") for o in over)


def test_split_cpus_keeps_each_physical_core_on_one_side(monkeypatch, tmp_path):
    from specsched.bench.serve_daemon import physical_cores, split_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    # hyperthreads numbered apart (CPU i and i + 8 share a core), as Linux numbers them on most x86
    sysfs = fake_topology(tmp_path / "smt", {i: f"{i % 8},{i % 8 + 8}" for i in range(16)})
    assert physical_cores(list(range(16)), sysfs)[:2] == [[0, 8], [1, 9]]
    daemon, clients = split_cpus(True, sysfs)
    assert daemon == {0, 1, 2, 3, 8, 9, 10, 11} and clients == {4, 5, 6, 7, 12, 13, 14, 15}
    # ranges, and siblings numbered together
    sysfs = fake_topology(tmp_path / "pairs", {i: f"{i - i % 2}-{i - i % 2 + 1}" for i in range(16)})
    daemon, clients = split_cpus(True, sysfs)
    assert daemon == set(range(8)) and clients == set(range(8, 16))
    # no topology: one group per CPU, the old halves
    assert split_cpus(True, str(tmp_path / "none")) == (set(range(8)), set(range(8, 16)))


def timed_result(chunks: list[tuple[float, float, int]], opens_at: float, window_s: float) -> PassResult:
    """A timed pass over plain (sent_at, arrival, tokens) triples, one request each."""
    reqs = [RequestResult(0, [1] * n, ttft_s=at - sent, sent_at=sent, chunk_at=[at], chunk_tokens=[n])
            for sent, at, n in chunks]  # fmt: skip
    return PassResult(opens_at + window_s + 1, reqs, window_s=window_s, ramp_s=opens_at, opens_at=opens_at,
                      closes_at=opens_at + window_s)  # fmt: skip


@pytest.mark.parametrize("passes", [2, 3])
@pytest.mark.parametrize("period", [1, 2, 3, 4, 12])
def test_pass_of_alternates_and_gives_every_pass_every_prompt(period, passes):
    from specsched.bench.serve_results import pass_of

    got = [pass_of(j, period, passes) for j in range(passes * period * 3)]
    # consecutive requests of one cycle go to other passes
    assert all(got[j] != got[j + 1] for j in range(len(got) - 1) if (j + 1) % period)
    for start in range(0, len(got), passes * period):  # every passes cycles: each prompt once per pass
        block = got[start : start + passes * period]
        for slot in range(period):
            assert sorted(block[slot::period]) == list(range(passes)), (slot, block)


def test_split_interleaved_deals_the_requests_and_weights_by_busy_time():
    from specsched.bench.serve_results import split_interleaved

    # one client (N = 1), window [1, 5): requests 1..4 back to back, 1 s each, prompt cycle of 2
    reqs = [
        RequestResult(0, [1] * n, ttft_s=0.1, latency_s=1.0, sent_at=sent, chunk_at=[sent + 0.5],
                      chunk_tokens=[n], seq=seq)
        for seq, (sent, n) in enumerate([(0.0, 5), (1.0, 10), (2.0, 20), (3.0, 30), (4.0, 40)])
    ]  # fmt: skip
    res = PassResult(6.0, reqs, window_s=4, ramp_s=1, opens_at=1, closes_at=5, concurrency=1)
    (p1, p2), rates = split_interleaved(res, 2, 2, 1.0)
    # pass_of with period 2: seq 0 -> 0, 1 -> 1, 2 -> 1, 3 -> 0, 4 -> 0
    assert [r.seq for r in p1.requests] == [0, 3, 4] and [r.seq for r in p2.requests] == [1, 2]
    assert rates == [10, 20, 30, 40]
    r1, r2 = summarize(p1), summarize(p2)
    assert r1["tokens_per_s"] == pytest.approx((30 + 40) / 2) and r2["tokens_per_s"] == pytest.approx(15)
    assert r1["requests_in_window"] == 2 and r2["requests_in_window"] == 2  # seq 0 was sent before it
    # four clients: N x tokens / busy seconds
    res4 = PassResult(6.0, reqs, window_s=4, ramp_s=1, opens_at=1, closes_at=5, concurrency=4)
    assert summarize(split_interleaved(res4, 2, 2, 1.0)[0][1])["tokens_per_s"] == pytest.approx(4 * 15)
    with pytest.raises(ValueError, match="need a timed pass"):
        split_interleaved(PassResult(1.0, []), 2, 2, 1.0)


def test_interleaved_passes_run_one_loop_per_n_on_a_real_daemon(tiny_daemon):
    """bench.serve.interleave_s: per N one loop of passes x duration_s, its requests dealt to the
    passes; both rows from that one loop, with the slices' tok/s beside them."""
    from types import SimpleNamespace

    from specsched.bench.serve import passes_of

    cfg = ServeConfig(configs=CONFIGS, duration_s=0.6, interleave_s=0.2, concurrency=[1, 2], max_tokens=16,
                      num_requests=1, request_timeout_s=60)  # fmt: skip
    bar = SimpleNamespace(set_postfix_str=lambda s: None, update=lambda n: None)
    got = list(passes_of(cfg, tiny_daemon, id_prompts(3), False, bar, "tiny"))
    assert [(p, n) for p, n, _, _ in got] == [(1, 1), (2, 1), (1, 2), (2, 2)]
    for (_, n, a, rates), (_, _, b, rates_b) in zip(got[::2], got[1::2]):
        ids_a, ids_b = {id(r) for r in a.requests}, {id(r) for r in b.requests}
        assert not ids_a & ids_b and len(ids_a | ids_b) > 2 * n and rates == rates_b and len(rates) == 6
        assert a.window_s == b.window_s == pytest.approx(1.2) and a.concurrency == b.concurrency == n
        ra, rb = summarize(a), summarize(b)
        assert ra["tokens_per_s"] > 0 and rb["tokens_per_s"] > 0
        # the passes together: the loop's tok/s (the clients' gaps between requests aside)
        lo, hi = a.opens_at, a.closes_at
        tokens = sum(r.tokens_in([(lo, hi)]) for r in a.requests + b.requests)
        busy = sum(r.busy_in(lo, hi) for r in a.requests + b.requests)
        assert n * tokens / busy == pytest.approx(sum(rates) / len(rates), rel=0.25)
        assert busy == pytest.approx(n * (hi - lo), rel=0.25)
