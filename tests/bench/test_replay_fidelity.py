"""Replay fidelity (bench/replay_fidelity.py) and the cost-error table (bench/cost_error_table.py) on
real decision logs of a tiny CPU engine: one log per policy, each holding two "passes" (one client
sending its requests one after another, then two clients sending theirs at once), as bench=serve
writes them."""

from __future__ import annotations

import dataclasses
import math
import random
import time

import pytest
import torch

from specsched.bench.cost_error_table import cost_error_rows, group_of, grouped
from specsched.bench.replay_fidelity import (
    THIN_STEPS,
    RequestTimes,
    coverage,
    live_rates,
    load_log,
    main,
    predicted_rates,
    split_passes,
    think_times,
)
from specsched.daemon.log import LogConfig, LogWriter
from specsched.engine.config import (
    CacheConfig,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from specsched.engine.engine import Engine
from specsched.engine.request import Request, SamplingParams
from specsched.policies.replay_log import load_run

K8 = {"name": "fixed", "k": 8, "scorer": "mqa"}
K0 = {"name": "fixed", "k": 0, "scorer": "mqa"}
MAX_TOKENS = 24


def make_engine(policy: dict) -> Engine:
    """Tiny random target with a 2-layer self-draft that rarely agrees with it: k = 8 runs 8 draft
    forwards a step for about one token, so its tok/s is a fraction of k = 0's, whatever the CPU's
    timing noise (runs on a shared CPU differ by ~25%)."""
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=1024),
        # one forward a step (no runs of plain steps alone, the default: tests/policies/test_replay_runs.py
        # replays those): k = 0 here takes one token a step, live and replayed
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, decode_steps=1),
        spec=SpecConfig(
            proposer="draft",
            scorers=["mqa", "batch_expansion"],
            max_k=8,  # batch expansion built, never run
            draft=DraftConfig(source="self", num_layers=2),
        ),
        policy=policy,
    )
    return Engine(cfg)


def closed_loop(engine: Engine, log: LogWriter, clients: dict[str, list[tuple[str, list[int]]]]) -> None:
    """Each client keeps one request in flight (as bench=serve's clients do) and sends its next one
    (request id, prompt) the moment it finishes: the next request's arrival is the last one's finish
    time, so the log's round trips are 0 however loaded the machine (the windowed replay waits each
    recorded round trip; a loaded CI box stretched these to steps and cut a pass's last request); every
    finished request gets its ``requests`` row."""
    queues = {c: list(q) for c, q in clients.items()}
    live: dict[str, Request] = {}

    def send(client: str, now: float) -> None:
        if queues[client]:
            rid, prompt = queues[client].pop(0)
            params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
            live[client] = Request(rid, prompt, params, arrival_time=now)
            engine.add_request(live[client])

    start = time.time()
    for c in queues:
        send(c, start)
    while live:
        engine.step()
        now = time.time()
        for client, r in list(live.items()):
            if r.finish_reason is None:
                continue
            log.write_request(
                r.request_id, client=client, arrival=r.arrival_time, first_token_time=r.first_token_time,
                finish_time=now, prompt_tokens=r.num_prompt_tokens, output_tokens=r.num_output_tokens,
                finish_reason=r.finish_reason, proposed=r.num_proposed, accepted=r.num_accepted,
            )  # fmt: skip
            del live[client]
            send(client, now)


def record(policy: dict, path) -> None:
    """Pass 1: client c0 sends 3 requests; pass 2: clients c1 and c2 send 2 each (the engine could
    run 4 at once: only the clients keep the batch at 2)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(4, 16))] for _ in range(7)]
    engine = make_engine(policy)
    log = LogWriter(LogConfig(path=str(path), flush_interval_s=0.05))
    log.start_run(dataclasses.asdict(engine.cfg), model="tiny", device="cpu", version="test")
    engine.on_step = log.write_step
    closed_loop(engine, log, {"c0": [(f"a{i}", prompts[i]) for i in range(3)]})
    time.sleep(0.01)  # an idle gap between the passes
    closed_loop(engine, log, {c: [(f"b{i}", prompts[3 + i]) for i in range(4) if i % 2 == j]
                              for j, c in enumerate(["c1", "c2"])})  # fmt: skip
    log.close()


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model is quickest on one thread, and the CI box is shared
    root = tmp_path_factory.mktemp("fidelity")
    for name, policy in (("k8", K8), ("k0", K0)):
        record(policy, root / f"{name}.sqlite")
    torch.set_num_threads(threads)
    return root


def test_split_passes_by_idle_gaps_and_clients():
    rt = [RequestTimes("w", "cw", 0.0, 1.0)]  # a warm-up request
    rt += [RequestTimes(f"a{i}", "c0", 2.0 + i, 2.9 + i) for i in range(3)]  # one client, one by one
    rt += [
        RequestTimes(f"b{i}", f"c{1 + i % 2}", 6.0 + i // 2, 6.8 + i // 2) for i in range(4)
    ]  # two at once
    rt += [RequestTimes("d0", "c9", 9.0, 9.5)]  # another single client
    passes = split_passes(rt, max_num_seqs=64)
    assert [(p.concurrency, p.keys) for p in passes] == [
        (1, ["w"]), (1, ["a0", "a1", "a2"]), (2, ["b0", "b1", "b2", "b3"]), (1, ["d0"])
    ]  # fmt: skip
    assert split_passes([RequestTimes("x", None, 0.0, 1.0)], max_num_seqs=8)[0].concurrency == 8  # no client
    # each pass keeps its busy periods: a's requests one each; b's two waves of two overlap in none
    assert [p.segments for p in passes] == [[0], [0, 1, 2], [0, 0, 1, 1], [0]]


def test_think_times_are_each_client_s_gap_between_finish_and_next_arrival():
    rt = [RequestTimes("a0", "c0", 0.0, 1.0), RequestTimes("b0", "c1", 0.1, 0.5),
          RequestTimes("b1", "c1", 0.503, 0.9), RequestTimes("a1", "c0", 1.02, 2.0),
          RequestTimes("x", None, 1.5, 1.7)]  # fmt: skip
    got = think_times(rt)
    assert got.keys() == {"a0", "b0", "b1", "a1", "x"}
    assert got["a0"] == got["b0"] == got["x"] == 0.0
    assert got["b1"] == pytest.approx(3.0) and got["a1"] == pytest.approx(20.0)


def test_passes_of_a_real_log_replay_at_their_own_concurrency(logs):
    log = load_log(str(logs / "k8.sqlite"))
    assert [(p.concurrency, len(p.keys)) for p, *_ in log.passes] == [(1, 3), (2, 4)]
    for p, part, bits, *_ in log.passes:
        assert {r.key for r in part.requests} == set(p.keys) and len(bits.bits) == len(p.keys)
        assert part.decode_steps and max(s.batch_size for s in part.decode_steps) == p.concurrency
        assert len(part.prefill_steps) >= 1
    assert sum(len(part.steps) for _, part, *_ in log.passes) == len(log.run.steps)  # every step in a pass
    # replayed pass by pass, the recorded policy takes the recorded number of steps (with the run's
    # max_num_seqs = 4 the replay would batch pass 1's three requests together: far fewer steps)
    predicted, live = predicted_rates(log, K8, windowed=False), live_rates(log)
    assert [(predicted[n].steps, predicted[n].tokens) for n in (1, 2)] == [
        (live[n].steps, live[n].tokens) for n in (1, 2)
    ]
    assert predicted[0].steps == len(log.run.decode_steps)
    assert predicted[0].tokens == sum(r.output_len for r in log.run.requests)
    # windowed (the default): each client's first request of a busy period always goes, and these
    # periods are each client's one or two requests: the same tokens; the steps move by a client's
    # round trip (the replay waits for it: a batch of one for a step)
    windowed = predicted_rates(log, K8)
    for n in (1, 2):
        assert windowed[n].tokens == live[n].tokens and abs(windowed[n].steps - live[n].steps) <= 2


def test_own_policy_predicts_its_own_tokens_per_s_and_a_wrong_one_does_not(logs):
    k8, k0 = load_log(str(logs / "k8.sqlite")), load_log(str(logs / "k0.sqlite"))
    live8, live0 = live_rates(k8), live_rates(k0)
    own, wrong = predicted_rates(k8, K8), predicted_rates(k8, K0)
    # the same steps, the same definition of tok/s: only the cost model's residual; a pass of a few
    # dozen CPU steps on a shared 2-core box misses by up to ~3%, and the whole run by 2.4 % once in a
    # fresh-clone CI (2026-12-07 13:20: 144.9 against 141.4 live), so 3 % there; the wrong policy
    # below is > 50 % off
    for n, rel in ((1, 0.05), (2, 0.05), (0, 0.03)):
        assert own[n].tokens_per_s == pytest.approx(live8[n].tokens_per_s, rel=rel), n
    assert live0[0].tokens_per_s > 2 * live8[0].tokens_per_s  # the test means something
    # k=0 replayed on k=8's log: far from k=8's own rate, and nearer k=0's live rate than k=8's rate is,
    # as a ratio either way (log scale: 1.57x above k=0's rate is nearer than 0.44x of it, which the
    # linear distance called a tie in one loaded CI run)
    assert wrong[0].tokens_per_s > 1.5 * live8[0].tokens_per_s
    assert abs(math.log(wrong[0].tokens_per_s / live0[0].tokens_per_s)) < abs(
        math.log(live8[0].tokens_per_s / live0[0].tokens_per_s)
    )
    assert wrong[0].steps == live0[0].steps  # greedy, one token a step: the same steps as live


def test_predicted_steps_of_an_unlogged_scorer_count_as_priced_from_thin_data(logs):
    log = load_log(str(logs / "k8.sqlite"))
    seen = coverage(log.run)
    assert {scorer for scorer, _, _ in seen} == {"mqa"} and sum(seen.values()) == len(log.run.decode_steps)
    own = predicted_rates(log, K8)[0]
    other = predicted_rates(log, {"name": "fixed", "k": 2, "scorer": "batch_expansion"})[0]
    assert other.steps > 0 and other.thin_share == 1.0  # never logged: every step from the prior
    assert own.thin_share < 0.1  # its own log: covered but for a few steps that drafted nothing


def test_drafting_steps_on_a_log_that_never_drafted_count_as_priced_from_thin_data(logs):
    """k = 0's log ran the MQA scorer at both batch sizes but drafted nothing: k = 8 replayed on it is
    priced with proposal and verification costs that log never measured."""
    log = load_log(str(logs / "k0.sqlite"))
    assert not any(drafted for _, _, drafted in coverage(log.run))
    assert predicted_rates(log, K8)[0].thin_share > 0.9  # all but its steps that drafted nothing
    assert predicted_rates(log, K0)[0].thin_share < 0.1


def test_cli_writes_the_table(logs, tmp_path, capsys):
    out = tmp_path / "t.md"
    k8, k0 = str(logs / "k8.sqlite"), str(logs / "k0.sqlite")
    assert main(["--replayed", k8, "--live", k8, "--live", k0, "--out", str(out), "--cost-error"]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| k")]
    assert [r.split(" | ")[1] for r in rows[:6]] == ["1", "2", "all", "1", "2", "all"]
    assert "| k8 | mqa | 1 |" in text and "| k8 | mqa | 2-4 |" in text  # the cost-error table's rows
    assert f"% steps priced from < {THIN_STEPS} logged" in text


def test_cost_error_groups_by_batch_range(logs):
    run = load_run(logs / "k8.sqlite")
    assert group_of(1) == (1, 1) and group_of(3) == (2, 4) and group_of(64) == (17, 64)
    assert {r.batch_size for r in grouped(run.decode_steps)} == {1, 4}  # batch 2 goes to the 2-4 group
    rows = cost_error_rows([("k8", run)])
    assert [(r[1], r[2]) for r in rows] == [("mqa", "1"), ("mqa", "2-4")]
    fit, held = int(rows[0][3]), int(rows[0][4])
    assert abs(fit - held) <= 1 and fit + held == sum(s.batch_size == 1 for s in run.decode_steps)


def test_cost_error_table_prices_with_the_runs_graph_buckets(logs):
    """The table scores the models the engine ran: with the graph buckets saved beside the log's
    cost models (padding, eager flags, per-graph residuals), as the regret bench's table does."""
    from specsched.policies.cost_error import held_out_error, prequential_error

    run = load_run(logs / "k8.sqlite")
    buckets = {"mqa": [1, 2, 3]}  # batch 4 is past the last bucket: eager; batches 1-3 padded
    with_graphs = dataclasses.replace(run, settings=dataclasses.replace(run.settings, graph_buckets=buckets))
    rows = cost_error_rows([("k8", with_graphs)])
    want = held_out_error(grouped(run.decode_steps), device="cpu", graph_buckets=buckets)
    assert [r[5] for r in rows] == [f"{100 * e.median:.1f}" for e in want]
    plain = held_out_error(grouped(run.decode_steps), device="cpu")
    assert [e.median for e in want] != [e.median for e in plain]  # the buckets change the prediction
    live = prequential_error(grouped(run.decode_steps), "cpu", buckets)  # the last column
    assert [r[-1] for r in rows] == [f"{100 * live[(e.scorer, e.batch_size)]:.1f}" for e in want]


def test_cost_error_reads_every_run_and_leaves_runs_of_plain_steps_out(logs, tmp_path, capsys):
    import shutil

    import sqlite_utils

    from specsched.bench.cost_error_table import main, read_log

    both = tmp_path / "both.sqlite"  # two runs in one log, as the regret bench writes one per window
    shutil.copy(logs / "k8.sqlite", both)
    db = sqlite_utils.Database(both)
    db.execute("insert into runs (started_at, config, model, device, version, schema_version) "
               "select started_at, config, model, device, version, schema_version from runs")  # fmt: skip
    db.execute("insert into steps select 2, step, kind, start_time, batch_size, num_tokens, scorer, policy, "
               "proposer, is_synthetic, predicted_propose_ms, predicted_score_ms, predicted_verify_ms, "
               "predicted_ms, propose_ms, score_ms, verify_ms, total_ms, num_emitted, plan_info, host_ms "
               "from steps where run_id = 1")  # fmt: skip
    db.execute("insert into step_requests select 2, step, request_id, context_len, k, num_accepted, "
               "match_bits, num_emitted, max_k from step_requests where run_id = 1")  # fmt: skip
    first = next(db.query("select min(step) as s from steps where run_id = 2 and kind = 'decode'"))["s"]
    db.execute(
        "update steps set plan_info = json_set(coalesce(plan_info, '{}'), '$.decode_steps', 4) "
        "where run_id = 2 and step = ?",
        [first],
    )  # one record a run of 4 plain steps
    db.conn.commit()
    db.close()
    one = load_run(logs / "k8.sqlite").decode_steps
    merged = read_log(str(both), all_runs=True).decode_steps
    assert len(merged) == 2 * len(one) and len(read_log(str(both)).decode_steps) == len(one)
    assert sum(s.num_decode_steps == 4 for s in merged) == 1
    assert len(grouped(merged)) == 2 * len(one) - 1  # the run is not one step
    assert main([str(both), "--all-runs"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| both |")]
    assert rows and sum(int(r.split("|")[4]) + int(r.split("|")[5]) for r in rows) == 2 * len(one) - 1


def test_window_times_span_the_arrivals_plus_half_a_gap():
    """Period 0: arrivals at 0, 1 and 2 s, steps of 10 ms starting at 0.5, 1.5 and 2.5 s: the steps
    between the first and last arrival (two, 20 ms) and half the mean gap (10 ms / 2). Period 1, one
    arrival: its steps at that instant only. A period with no timed request: 0."""
    from specsched.bench.replay_passes import Pass, window_times
    from specsched.engine.records import StepRecord

    p = Pass(2, ["a", "b", "c", "d"], {"x"}, 0.0, 9.0, [0, 0, 0, 1])
    times = [RequestTimes(k, "x", t, t + 0.4) for k, t in (("a", 0.0), ("b", 1.0), ("c", 2.0), ("d", 5.0))]
    steps = [StepRecord(i, "decode", t, 1, 1, total_ms=10.0) for i, t in enumerate((0.5, 1.5, 2.5, 5.0))]
    assert window_times(p, times, steps) == [pytest.approx(25.0), pytest.approx(10.0)]
    assert window_times(Pass(1, ["z"], {"x"}, 0.0, 1.0, [0]), [], steps) == [0.0]
