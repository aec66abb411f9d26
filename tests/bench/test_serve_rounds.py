"""bench.serve.rounds: every config's daemon up at once, per N rounds of one timed loop per config in
a seeded order; real daemons (tiny preset, CPU) on loopback, real decision logs."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import specsched.bench.cli as cli
import specsched.bench.serve_report as serve_report
import specsched.bench.serve_requests as serve_requests
import specsched.bench.serve_rounds as serve_rounds
import specsched.bench.serve_runs as serve_runs
from specsched.bench.serve_config import ServeConfig
from specsched.bench.serve_daemon import safe_name
from tests.bench.test_serve_cpu import pid_gone

CONF_DIR = str(Path(cli.__file__).parent / "conf")
CONFIGS = [
    {"name": "non-speculative", "kind": "baseline",
     "overrides": ["proposer=none", "policy=fixed", "policy.k=0", "policy.scorer=batch_expansion"]},
    {"name": "broken", "kind": "policy", "overrides": ["proposer.max_k=-1"]},  # exits at config check
    {"name": "ngram k=2 MQA", "kind": "fixed",
     "overrides": ["proposer=ngram", "policy=fixed", "policy.k=2", "policy.scorer=mqa"]},
    {"name": "ngram goodput", "kind": "default", "overrides": ["proposer=ngram", "policy=goodput"]},
]  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rounds": 2}, "rounds must be 0 or >= 1 with duration_s > 0"),
        ({"rounds": 2, "duration_s": 1, "rounds_per_n": [1, 2]}, "rounds_per_n must give every N"),
        ({"rounds": 2, "duration_s": 1, "rounds_per_n": [1, 2, 0, 3]}, "rounds_per_n must give every N"),
        ({"rounds": 0, "duration_s": 1, "rounds_per_n": [1, 2, 2, 3]}, "rounds > 0: rounds mode"),
        ({"rounds": -1, "duration_s": 1}, "rounds must be 0 or >= 1"),
        ({"rounds": 2, "duration_s": 1, "prompts": "ids", "oracle_override": "+proposer.oracle"},
         "rounds needs oracle_override null"),
    ],
)  # fmt: skip
def test_serve_config_rejects_bad_rounds(change, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(**{"configs": CONFIGS, **change})


@pytest.mark.parametrize(
    "reference, rounds, message",
    [
        ("nope", 2, "must name another config"),
        ("ngram goodput", 2, "must name another config"),  # itself
        ("broken", 0, "needs rounds mode"),
    ],
)
def test_serve_config_rejects_bad_references(reference, rounds, message):
    configs = [*CONFIGS[:3], {**CONFIGS[3], "reference": reference}]
    with pytest.raises(ValueError, match=message):
        ServeConfig(configs=configs, duration_s=1, rounds=rounds)
    chained = [{**CONFIGS[0]}, {**CONFIGS[2], "reference": "ngram goodput"},
               {**CONFIGS[3], "reference": "non-speculative"}]  # fmt: skip
    with pytest.raises(ValueError, match="without a reference of its own"):
        ServeConfig(configs=chained, duration_s=1, rounds=2)
    referring = [*CONFIGS[:3], {**CONFIGS[3], "reference": "ngram k=2 MQA"}]
    ok = ServeConfig(configs=referring, duration_s=1, rounds=2)
    assert ok.referenced == {"ngram k=2 MQA"}


def test_rounds_at_each_concurrency():
    cfg = ServeConfig(configs=CONFIGS, duration_s=1, rounds=3, rounds_per_n=[2, 3, 3, 5])
    assert [cfg.rounds_at(n) for n in (1, 4, 16, 64)] == [2, 3, 3, 5]
    assert ServeConfig(configs=CONFIGS, duration_s=1, rounds=3).rounds_at(64) == 3


@pytest.mark.slow
@pytest.mark.parametrize("interleave_s", [0, 0.1], ids=["pass_per_round", "dealt_passes"])
def test_rounds_keep_every_daemon_up_and_interleave_the_configs(tmp_path, interleave_s, capsys):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("bench", overrides=[
            "bench=serve_tiny", f"bench.out_dir={tmp_path}", f"bench.serve.log_dir={tmp_path / 'dblogs'}",
            "bench.serve.duration_s=0.3", "bench.serve.rounds=2", "bench.serve.round_overrides=[]",
            f"bench.serve.interleave_s={interleave_s}",
            *(["bench.serve.rounds_per_n=[2,3]"] if interleave_s else []),  # N = 2 gets a third round
        ]).bench  # fmt: skip
    rounds = {1: 2, 2: 3 if interleave_s else 2}
    cfg.serve.configs = OmegaConf.create(CONFIGS)
    partials: list[dict] = []  # serve_logs/partial.json after each N (what a run cut short leaves)
    inner = serve_rounds.run_rounds

    def spy(*args):
        def on_n(infos, rows, write=args[-1]):
            write(infos, rows)
            partials.append(json.loads((tmp_path / "serve_logs" / "partial.json").read_text()))

        return inner(*args[:-1], on_n)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serve_rounds, "run_rounds", spy)
        res = cli.run_bench(cfg, "test")
    assert [sorted({r["concurrency"] for r in p["rows"]}) for p in partials] == [[1], [1, 2]]
    live_names = {"non-speculative", "ngram k=2 MQA", "ngram goodput"}
    assert all(p["is_partial"] and {r["config"] for r in p["rows"]} == live_names for p in partials)
    (tmp_path / "first_n.json").write_text(json.dumps(partials[0]))
    capsys.readouterr()
    serve_report.main([str(tmp_path / "first_n.json")])  # renders what a run cut after N = 1 leaves
    shown = capsys.readouterr().out
    assert shown.startswith("Partial results") and "Targets (issue 12)" in shown
    assert "| ngram goodput |" in shown
    if interleave_s and os.path.isdir("/proc/self/task"):  # each loop's load and daemon threads, rendered
        assert "load process core share (busiest)" in shown and "The daemon's threads in each round" in shown
    assert res["errors"] == {}
    serve = res["serve"]
    info = {c["name"]: c for c in serve["configs"]}
    assert list(info) == [c["name"] for c in CONFIGS]
    assert info["broken"]["startup_s"] is None and "proposer.max_k" in info["broken"]["error"]
    live = [n for n in info if n != "broken"]
    for name in live:
        assert info[name]["error"] is None and info[name]["exit_status"] == 0 and info[name]["startup_s"] > 0
        mine = [r for r in serve["rows"] if r["config"] == name]
        assert sorted((r["concurrency"], r["pass"]) for r in mine) == [(1, 1), (1, 2), (2, 1), (2, 2)]
        for r in mine:
            assert r["tokens_per_s"] > 0 and r["error"] is None and r["num_errors"] == 0
            assert r["same_output"] == 1.0  # float32 on CPU: lossless, every prompt has a reference
            if interleave_s:  # each pass pools its share of every round's 0.6 s loop
                num = rounds[r["concurrency"]]
                assert len(r["round_tok_s"]) == num and len(r["slice_tok_s"]) == num * 6
                # each round's loop found in the daemon's log, its host ms beside its tok/s
                assert len(r["round_host_ms"]) == num and min(r["round_host_ms"]) > 0, r
                # the engine thread's CPU taken away during each loop (Linux /proc, daemon/host_stats.py)
                assert len(r["round_switches"]) == num and all(x >= 0 for x in r["round_switches"]), r
                # the busiest load process's core share in each loop (its clients did run: > 0)
                assert len(r["round_load_share"]) == num and all(0 < x < 4 for x in r["round_load_share"]), r
                if os.path.isdir("/proc/self/task"):  # the daemon's threads' CPU in each loop (host_stats)
                    assert len(r["round_threads"]) == num, r
                    for x in r["round_threads"]:
                        assert 0 < x["engine"] <= 1.05 and 0 < x["io"] <= 1.05, r
                        assert x["process"] >= x["engine"], r
                assert r["window_s"] == pytest.approx(num * 0.6)
                assert 0.5 * min(r["round_tok_s"]) < r["tokens_per_s"] < 2 * max(r["round_tok_s"])
            else:
                assert r["round_tok_s"] is None and r["window_s"] == pytest.approx(0.3)
    assert {r["config"] for r in serve["rows"]} == set(live)
    # the configs' decode steps interleave in time: each daemon served between the others' loops
    spans = {}
    for name in live:
        db = sqlite3.connect(tmp_path / "dblogs" / f"{name.replace(' ', '_').replace('=', '_')}.sqlite")
        times = [t for (t,) in db.execute("select start_time from steps where kind = 'decode' order by 1")]
        db.close()
        assert times, name
        spans[name] = (times[0], times[-1])
    for a in live:
        for b in live:
            if a != b:  # every pair of time ranges overlaps (one daemon at a time would not)
                assert spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1], (a, b, spans)
    text = (tmp_path / "tables.md").read_text()
    assert (
        "2/3 (N = 1/2) rounds, each one loop per" if interleave_s else "2 rounds, each one loop per"
    ) in text
    assert ("Tok/s of each round's loop" in text) == bool(interleave_s)
    # every daemon's loops in time order, with its host index (bench/serve_drift.py)
    assert "The host's speed loop by loop" in text
    assert ("Each round's loop (tok/s, its host ms" in text) == bool(interleave_s)
    drift = [line.split(" | ")[1] for line in serve["drift"].splitlines() if line[2:3].isdigit()]
    assert {name.replace(" ", "_").replace("=", "_") for name in live} <= set(drift), serve["drift"]
    # goodput against the fixed row by prompt, as rows in results.json: what bench/serve_runs.py pools
    paired = json.loads((tmp_path / "results.json").read_text())["serve"]["by_prompt_rows"]
    assert {r["config"] for r in paired} == {"ngram_goodput"} and {r["N"] for r in paired} == {1, 2}
    assert serve_runs.token_rows(serve_runs.load_serve(tmp_path)) == [r for r in paired if "skipped" not in r]
    # every timed request as its client saw it (bench/serve_requests.py), and its summary in the report
    requests = serve_requests.read_rows(tmp_path)
    for name in live:
        for n in (1, 2):
            mine = [q for q in requests if q["config"] == name and q["n"] == n]
            assert {q["round"] for q in mine} == set(range(rounds[n])), (name, n)
            assert {q["client"] for q in mine} == set(range(n)) and all(q["busy"] >= 0 for q in mine)
            if interleave_s:  # dealt by request number, the passes' tok/s are the table's own
                table = sorted((r for r in serve["rows"] if r["config"] == name and r["concurrency"] == n),
                               key=lambda r: r["pass"])  # fmt: skip
                got = serve_requests.pass_rates(mine, "seq")
                assert got == pytest.approx([r["tokens_per_s"] for r in table], rel=1e-9), (name, n)
    assert ("Each request as its client saw it" in text) == bool(interleave_s)  # dealt passes only
    # each request paired with its daemon's record by id, on one clock: sent before the daemon had it,
    # its first token made before the client got it
    times = serve_requests.daemon_times(sorted((tmp_path / "dblogs").glob("*.sqlite")))
    for q in (q for q in requests if q["config"] in live and not q["is_error"]):
        arrival, first, _ = times[q["id"]]
        assert q["sent_wall"] <= arrival <= first <= q["sent_wall"] + q["first"] - q["sent"], q
    assert ("Where a request's time went" in text) == bool(interleave_s)


@pytest.mark.slow
def test_a_config_checks_its_outputs_against_its_own_reference(tmp_path):
    """Other weights (model.seed=7) give other outputs than the baseline's: a speculative row on them
    matches its reference (the non-speculative row on the same weights), not the baseline."""
    seven = ["model.seed=7"]
    configs = [
        CONFIGS[0],
        {"name": "non-spec seed 7", "kind": "fixed", "overrides": [*CONFIGS[0]["overrides"], *seven]},
        {"name": "ngram seed 7", "kind": "fixed", "overrides": [*CONFIGS[2]["overrides"], *seven],
         "reference": "non-spec seed 7"},
        {"name": "ngram seed 7 vs baseline", "kind": "policy",
         "overrides": [*CONFIGS[2]["overrides"], *seven]},
    ]  # fmt: skip
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("bench", overrides=[
            "bench=serve_tiny", f"bench.out_dir={tmp_path}", "bench.serve.duration_s=0.3",
            "bench.serve.rounds=1", "bench.serve.round_overrides=[]", "bench.serve.concurrency=[2]",
        ]).bench  # fmt: skip
    cfg.serve.configs = OmegaConf.create(configs)
    res = cli.run_bench(cfg, "test")
    assert res["errors"] == {}
    same = {r["config"]: r["same_output"] for r in res["serve"]["rows"] if r["pass"] == 1}
    assert same["non-speculative"] == 1.0
    assert same["ngram seed 7"] == 1.0  # against its own reference: lossless
    assert same["non-spec seed 7"] < 1.0 and same["ngram seed 7 vs baseline"] < 1.0  # other weights


def test_replicas_need_rounds_mode_and_alternate_by_round_and_n():
    from specsched.bench.serve_rounds import replica_of

    with pytest.raises(ValueError, match="replicas must be >= 1, and 1 unless rounds mode"):
        ServeConfig(configs=CONFIGS, duration_s=1, replicas=2)
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        ServeConfig(configs=CONFIGS, duration_s=1, rounds=2, replicas=0)
    assert ServeConfig(configs=CONFIGS, duration_s=1, rounds=2, replicas=2).replicas == 2
    # 3 rounds on 2 replicas: 0, 1, 0 at the first N, 1, 0, 1 at the second (each replica's share evens out)
    assert [replica_of(r, 0, 2) for r in range(3)] == [0, 1, 0]
    assert [replica_of(r, 1, 2) for r in range(3)] == [1, 0, 1]
    assert {replica_of(r, 0, 1) for r in range(4)} == {0}


def test_the_replica_table_sets_each_replica_s_rounds_side_by_side():
    from specsched.bench.serve_replicas import replica_rates, replica_table

    dealt = {"config": "a", "concurrency": 4, "num_errors": 0, "error": None,
             "round_tok_s": [100.0, 120.0, 104.0], "round_replica": [1, 2, 1]}  # fmt: skip
    rows = [{**dealt, "pass": 1}, {**dealt, "pass": 2},  # both dealt passes carry the same rounds
            {"config": "b", "concurrency": 4, "pass": 1, "num_errors": 0, "replica": 2, "tokens_per_s": 50.0},
            {"config": "b", "concurrency": 4, "pass": 2, "num_errors": 0, "replica": 1, "tokens_per_s": 40.0},
            {"config": "c", "concurrency": 4, "pass": 1, "num_errors": 2, "replica": 1,
             "tokens_per_s": 9.0}]  # fmt: skip
    assert replica_rates(rows) == {
        ("a", 4): {1: [100.0, 104.0], 2: [120.0]},
        ("b", 4): {2: [50.0], 1: [40.0]},
    }
    text = replica_table(rows)
    assert "| a | 4 | 102.0 (2) | 120.0 (1) | 17.6% |" in text
    assert "| b | 4 | 40.0 (1) | 50.0 (1) | 25.0% |" in text and "| c |" not in text
    assert replica_table([{k: v for k, v in rows[0].items() if k != "round_replica"}]) == ""


@pytest.mark.slow
def test_each_config_runs_in_two_daemons_that_take_the_rounds_in_turn(tmp_path):
    """bench.serve.replicas=2: every config has two daemons (two pids, two decision logs), round r at
    the i-th N is served by replica (r + i) mod 2, both replicas' decode steps are in their logs, and
    the tables show each replica's tok/s."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("bench", overrides=[
            "bench=serve_tiny", f"bench.out_dir={tmp_path}", f"bench.serve.log_dir={tmp_path / 'dblogs'}",
            "bench.serve.duration_s=0.3", "bench.serve.rounds=3", "bench.serve.round_overrides=[]",
            "bench.serve.interleave_s=0.1", "bench.serve.replicas=2",
        ]).bench  # fmt: skip
    cfg.serve.configs = OmegaConf.create([CONFIGS[0], CONFIGS[2]])
    res = cli.run_bench(cfg, "test")
    assert res["errors"] == {}
    serve = res["serve"]
    for c in serve["configs"]:
        assert c["error"] is None and c["exit_status"] == 0
        (twin,) = c["replicas"]
        assert twin["error"] is None and twin["exit_status"] == 0 and twin["startup_s"] > 0
        assert twin["pid"] != c["pid"] and pid_gone(twin["pid"]) and pid_gone(c["pid"])
        assert twin["name"] == f"{c['name']} replica 2"
        if os.path.isdir("/proc/self/task"):  # each replica's own kernel counters (daemon/host_stats.py)
            assert c["host"]["num_threads"] >= 2 and twin["host"]["num_threads"] >= 2
        for name in (c["name"], twin["name"]):  # each replica served decode steps into its own log
            db = sqlite3.connect(tmp_path / "dblogs" / f"{safe_name(name)}.sqlite")
            assert db.execute("select count(*) from steps where kind = 'decode'").fetchone()[0] > 0
            db.close()
    for r in serve["rows"]:
        assert r["round_replica"] == ([1, 2, 1] if r["concurrency"] == 1 else [2, 1, 2])
        assert len(r["round_tok_s"]) == 3 and r["same_output"] == 1.0
    text = (tmp_path / "tables.md").read_text()
    assert "Tok/s by daemon replica" in text and "replica 2: median tok/s (rounds)" in text
    assert "each config served by 2 daemon processes (replicas)" in text
    if os.path.isdir("/proc/self/task"):
        assert "| ngram k=2 MQA replica 2 | " in text.split("The kernel's counters for each daemon")[1]
