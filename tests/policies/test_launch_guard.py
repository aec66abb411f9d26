"""Steps whose scoring launch the host was slow to issue teach the cost models nothing
(policies/launch_guard.py): their score ms carries the host's delay, not the graph's cost."""

from __future__ import annotations

import pytest

from specsched.engine.records import StepRecord, StepRequestRecord
from specsched.policies.cost_model import CostModels
from specsched.policies.launch_guard import LaunchGuard
from specsched.policies.shapes import StepShape


def step(score_ms: float, launch_ms: float | None, k: int = 8) -> StepRecord:
    """A batch-1 MQA-graph step whose score phase's host part (the launch) took ``launch_ms``."""
    host = {} if launch_ms is None else {"score": launch_ms, "between": 0.05}
    return StepRecord(
        0, "decode", 0.0, 1, k + 1, scorer="mqa_graph", proposer="ngram",
        requests=[StepRequestRecord("r0", 299, k, 2)], propose_ms=0.05, score_ms=score_ms, verify_ms=0.02,
        total_ms=score_ms + 0.3, host_ms=host,
    )  # fmt: skip


def test_the_guard_flags_a_launch_over_twice_its_typical_time_and_follows_a_lasting_change():
    guard = LaunchGuard()
    assert not guard.is_disturbed("mqa_graph", 1, 0.24)  # the first step sets the typical value
    assert not any(guard.is_disturbed("mqa_graph", 1, 0.24 + 0.01 * (i % 3)) for i in range(50))
    assert guard.is_disturbed("mqa_graph", 1, 0.9)
    assert not guard.is_disturbed("mqa_graph", 4, 0.9)  # another batch size: its own typical value
    assert not guard.is_disturbed("mqa_graph", 1, None)  # not timed (the CPU path): never flagged
    assert guard.num_disturbed == 1
    # the host became 3x slower for good: flagged at first, learnt again within ~15 steps
    flagged = [guard.is_disturbed("mqa_graph", 1, 0.75) for _ in range(40)]
    assert flagged[0] and not any(flagged[20:]), flagged
    with pytest.raises(ValueError, match="ratio"):
        LaunchGuard(ratio=1.0)


def test_a_slow_launch_teaches_no_model_and_the_graph_stays_priced_right():
    """A graph served at 1.05 ms, then a stretch of 12 steps with the host slow (launch 0.6-2 ms, score
    1.4-3 ms, under the stall guard's 4x): the models skip them, the graph's price stays at 1.05; with
    the guard off (ratio too high to trip) they learn the stretch and price the graph 10 %+ dearer."""
    prices = {}
    for ratio in (2.0, 1e9):
        costs = CostModels({"mqa_graph": [1, 2, 4, 8, 9, 16]}, device="cuda")
        costs.launch_guard.ratio = ratio
        for i in range(200):
            assert costs.observe(step(1.05 + 0.01 * (i % 3), 0.24 + 0.01 * (i % 2)))
        coefs = {key: m.coef.copy() for key, m in costs.models.items()}
        learnt = [costs.observe(step(1.4 + 0.15 * (i % 12), 0.6 + 0.12 * (i % 12))) for i in range(12)]
        if ratio == 2.0:
            assert not any(learnt) and costs.launch_guard.num_disturbed == 12
            assert all((costs.models[key].coef == c).all() for key, c in coefs.items())
        prices[ratio] = costs.predict("mqa_graph", "ngram", StepShape([8], [300])).score_ms
    assert prices[2.0] == pytest.approx(1.06, abs=0.02)
    assert prices[1e9] > 1.1 * prices[2.0], prices
