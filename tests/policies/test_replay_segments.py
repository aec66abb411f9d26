"""Replaying a serving log by concurrency: segments where the engine ran dry, each level replayed
with max_num_seqs = its concurrency (a real LogWriter log, hand-built steps)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from specsched.policies.replay import ReplayOptions, replay
from specsched.policies.replay_log import load_run
from specsched.policies.replay_segments import format_levels, level_of, replay_by_level

_spec = importlib.util.spec_from_file_location("replay_helpers", Path(__file__).with_name("test_replay.py"))
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
CONFIG, decode_step, write_log = _helpers.CONFIG, _helpers.decode_step, _helpers.write_log


def loop(step: int, ids: list[str], length: int, n: int) -> tuple[list, int]:
    """Decode steps of requests ``ids`` (``length`` output tokens each, every draft rejected) with at
    most ``n`` running at once, joining in order."""
    steps, queue, live, pos = [], list(ids), [], {}
    while queue or live:
        while queue and len(live) < n:
            r = queue.pop(0)
            live.append(r)
            pos[r] = 0
        steps.append(decode_step(step, [(r, 10 + pos[r], 1, 0) for r in live]))
        step += 1
        for r in live:
            pos[r] += 1
        live = [r for r in live if pos[r] < length - 1]
    return steps, step


def test_levels_round_a_batch_up():
    assert [level_of(b) for b in (1, 2, 4, 5, 16, 17, 64, 99)] == [1, 4, 4, 16, 16, 64, 64, 64]


def test_a_serving_log_replays_each_concurrency_apart(tmp_path):
    # N = 1: three requests one after the other (each its own segment); then N = 4: eight requests
    singles = []
    step = 0
    for r in ("s0", "s1", "s2"):
        steps, step = loop(step, [r], 5, 1)
        singles += steps
    quads, step = loop(step, [f"q{i}" for i in range(8)], 5, 4)
    requests = [(r, 10, 5) for r in ("s0", "s1", "s2")] + [(f"q{i}", 10, 5) for i in range(8)]
    write_log(
        tmp_path / "serve.sqlite", {**CONFIG, "scheduler": {"max_num_seqs": 64}}, singles + quads, requests
    )
    run = load_run(tmp_path / "serve.sqlite")
    levels = replay_by_level(run, [{"name": "fixed", "k": 2, "scorer": "mqa"}], ReplayOptions())
    # N = 4 ran in two waves of four here (equal lengths): two segments of one level
    assert [(lv.level, lv.num_segments, lv.num_requests) for lv in levels] == [(1, 3, 3), (4, 2, 8)]
    one, four = levels
    # every draft rejected: one token per request per step; N = 1 runs each request alone
    assert one.rows[0].source == "recorded" and one.rows[0].num_steps == 12
    assert [t.batch_size for t in one.rows[1].trace] == [1] * 12
    assert four.rows[1].num_steps == 8 and {t.batch_size for t in four.rows[1].trace} == {4}
    # the plain replay batches all eleven requests up to the log's max_num_seqs of 64
    assert replay(run, [{"name": "fixed", "k": 2, "scorer": "mqa"}]).rows[1].trace[0].batch_size == 11
    table = format_levels(levels)
    assert "fixed k=2 " in table and table.count("\n") == 4  # a header, 2 levels x (recorded, fixed)


def test_closed_loop_replay_keeps_one_request_per_client():
    """Two clients of three requests each (a: 5 tokens, b: 3): with ``closed_loop`` a client's next
    request joins only when its last one finished, so at most two run, each client's in its order;
    without, the replay fills max_num_seqs with all six at once."""
    import dataclasses

    from specsched.policies.registry import build_policy
    from specsched.policies.replay import simulate
    from specsched.policies.replay_bits import MatchBits
    from specsched.policies.replay_costs import refit_costs
    from specsched.policies.replay_log import RecordedRequest, RecordedRun, RunSettings

    reqs = [
        RecordedRequest(f"{c}{i}", 10, n, i, [None] * n, {}, True, client=c)
        for i in range(3)
        for c, n in (("a", 5), ("b", 3))
    ]
    settings = RunSettings("draft", 8, 64, ["mqa"], 4, None, {"name": "fixed", "k": 0, "scorer": "mqa"})
    run = RecordedRun("mem", 1, "m", "cpu", "t", settings, [], reqs)
    none = [[False] * r.output_len for r in reqs]
    bits = MatchBits(none, none, 0.0, 0, 0)
    costs = refit_costs(run)
    policy = {"name": "fixed", "k": 0, "scorer": "mqa"}
    closed = simulate(run, bits, build_policy(policy), costs, "x", closed_loop=True)
    sizes = [t.batch_size for t in closed.trace]
    assert max(sizes) == 2 and closed.num_decode_tokens == sum(r.output_len - 1 for r in reqs)
    # a's three requests take 4 steps each, b's 2 each: b runs out after step 6, a goes on alone
    assert sizes == [2] * 6 + [1] * 6
    open_ = simulate(run, bits, build_policy(policy), costs, "x")
    assert [t.batch_size for t in open_.trace][0] == 6
    no_clients = dataclasses.replace(run, requests=[dataclasses.replace(r, client=None) for r in reqs])
    assert [t.batch_size for t in simulate(no_clients, bits, build_policy(policy), costs, "x",
                                           closed_loop=True).trace][0] == 6  # fmt: skip


def _two_clients(lengths: dict[str, int], n: int = 3):
    from specsched.policies.replay_bits import MatchBits
    from specsched.policies.replay_log import RecordedRequest, RecordedRun, RunSettings

    reqs = [
        RecordedRequest(f"{c}{i}", 10, length, i, [None] * length, {}, True, client=c)
        for i in range(n)
        for c, length in lengths.items()
    ]
    settings = RunSettings("draft", 8, 64, ["mqa"], 4, None, {"name": "fixed", "k": 0, "scorer": "mqa"})
    run = RecordedRun("mem", 1, "m", "cpu", "t", settings, [], reqs)
    none = [[False] * r.output_len for r in reqs]
    return run, MatchBits(none, none, 0.0, 0, 0)


def test_a_later_busy_period_joins_only_once_the_batch_drained():
    """Requests a0 b0 (period 0) then a1 b1 a2 b2 (period 1): with ``segments`` b1 waits for a0 to
    finish although its own client's b0 finished long before (the live batch drained there)."""
    from specsched.policies.registry import build_policy
    from specsched.policies.replay import simulate
    from specsched.policies.replay_costs import refit_costs

    run, bits = _two_clients({"a": 6, "b": 2})
    policy = build_policy({"name": "fixed", "k": 0, "scorer": "mqa"})
    costs = refit_costs(run)
    free = [t.batch_size for t in simulate(run, bits, policy, costs, "x", closed_loop=True).trace]
    assert free[:2] == [2, 2]  # b1 joined right after b0's one step
    drained = simulate(run, bits, policy, costs, "x", closed_loop=True, segments=[0, 0, 1, 1, 1, 1])
    sizes = [t.batch_size for t in drained.trace]
    assert sizes[:5] == [2, 1, 1, 1, 1]  # b0 (1 step), then a0 alone until it is done (5 steps)
    assert sizes[5] == 2  # period 1 starts: a1 and b1 together
    assert drained.num_decode_tokens == free_tokens(run)


def free_tokens(run) -> int:
    return sum(r.output_len - 1 for r in run.requests)


def test_a_client_s_round_trip_delays_its_next_request_in_the_replay_clock():
    """``think_ms``: b's next request joins its round trip after b's last finished, in predicted ms;
    while nobody is ready the clock jumps (idle, counted on neither side)."""
    from specsched.policies.registry import build_policy
    from specsched.policies.replay import simulate
    from specsched.policies.replay_costs import refit_costs

    run, bits = _two_clients({"a": 9, "b": 2})
    policy = build_policy({"name": "fixed", "k": 0, "scorer": "mqa"})
    costs = refit_costs(run)
    step_ms = simulate(run, bits, policy, costs, "x", closed_loop=True).trace[0].predicted_ms
    think = [0.0, 0.0, 0.0, 3.5 * step_ms, 0.0, 3.5 * step_ms]  # b1 and b2 come 3.5 steps late
    late = simulate(run, bits, policy, costs, "x", closed_loop=True, think_ms=think)
    sizes = [t.batch_size for t in late.trace]
    # step 1: a0 b0; b0 done; b1 ready after 3.5 more steps: joins at step 6 (the 5th after step 1)
    assert sizes[:6] == [2, 1, 1, 1, 1, 2]
    assert late.num_decode_tokens == free_tokens(run)
    assert late.predicted_ms == pytest.approx(sum(t.predicted_ms for t in late.trace))  # no idle counted


def test_a_windowed_replay_keeps_its_clients_sending_for_the_live_window_then_drains():
    """window_ms: a's requests are 6 tokens, b's 2; replayed once each, b runs out early and a goes on
    alone (the tail a slower policy makes). With a window the clients send for that long, going round
    their requests again; past it each drains; a window of 0 lets each client send its first only."""
    from specsched.policies.registry import build_policy
    from specsched.policies.replay import simulate
    from specsched.policies.replay_costs import refit_costs

    run, bits = _two_clients({"a": 6, "b": 2}, n=3)
    policy = build_policy({"name": "fixed", "k": 0, "scorer": "mqa"})
    costs = refit_costs(run)
    once = simulate(run, bits, policy, costs, "x", closed_loop=True)
    step_ms = once.trace[0].predicted_ms
    assert [t.batch_size for t in once.trace].count(1) >= 10  # a's last two requests alone
    window = simulate(run, bits, policy, costs, "x", closed_loop=True, window_ms=[12 * step_ms])
    sizes = [t.batch_size for t in window.trace]
    assert window.num_admitted > len(run.requests)  # b went round its requests again
    assert sizes[:12] == [2] * 12 and sizes.count(1) <= 5  # both busy through the window, then a drains
    assert window.predicted_ms == pytest.approx(sum(t.predicted_ms for t in window.trace))  # no prefills
    first_only = simulate(run, bits, policy, costs, "x", closed_loop=True, window_ms=[0.0])
    assert first_only.num_admitted == 2 and first_only.num_decode_tokens == 5 + 1


def test_a_windowed_replay_never_loops_on_requests_without_decode_steps():
    from specsched.policies.registry import build_policy
    from specsched.policies.replay import simulate
    from specsched.policies.replay_costs import refit_costs

    run, bits = _two_clients({"a": 1, "b": 1}, n=2)  # each request is its prefill token alone
    res = simulate(run, bits, build_policy({"name": "fixed", "k": 0, "scorer": "mqa"}), refit_costs(run),
                   "x", closed_loop=True, window_ms=[5.0])  # fmt: skip
    assert res.num_admitted == 4 and res.num_steps == 0 and res.num_tokens == 4


def test_a_window_leaves_out_the_replay_s_idle_waits():
    """Two clients whose first requests finish together, then both wait a 50 ms round trip with
    nothing running: the live window (the steps' ms) has no such time, so the replay's window of
    10 ms is still open after the wait and both second requests go; without the waits left out the
    clock (55 ms) would have closed it and only the first requests would have been replayed."""
    from specsched.policies.replay_clients import Arrivals
    from specsched.policies.replay_log import RecordedRequest

    reqs = [RecordedRequest(f"{c}{i}", 4, 3, 0, [None] * 3, client=c) for i in range(2) for c in "ab"]
    arr = Arrivals(reqs, closed_loop=True, segments=[0] * 4, think_ms=[0.0, 0.0, 50.0, 50.0],
                   window_ms=[10.0])  # fmt: skip
    assert arr.admit(4, is_drained=True) == [0, 1]
    arr.clock += 5.0  # one step: both finish
    arr.finish(0)
    arr.finish(1)
    assert arr.admit(4, is_drained=True) == []  # both clients in their round trips
    arr.wait()
    assert arr.clock == pytest.approx(55.0) and arr.is_open
    assert arr.admit(4, is_drained=True) == [2, 3]
    arr.clock += 6.0  # past the window now: 11 ms of steps
    arr.finish(2)
    arr.finish(3)
    arr.wait()
    assert not arr.is_open and arr.admit(4, is_drained=True) == []  # the window closed: it drains
