from __future__ import annotations

import pytest

from specsched.policies.base import BatchView, RequestView
from specsched.policies.cost_model import CostModels
from specsched.policies.fixed import (
    DisableByBatchConfig,
    DisableByBatchPolicy,
    FixedConfig,
    FixedPolicy,
    ThresholdConfig,
    ThresholdPolicy,
)
from specsched.policies.heuristic import HfHeuristicConfig, HfHeuristicPolicy, hf_next_k
from specsched.policies.registry import POLICIES, build_policy

SCORERS = ["batch_expansion", "mqa"]


def make_view(
    n: int, a: float = 0.5, max_k: list[int] | int = 8, proposer: str = "draft", **last
) -> BatchView:
    caps = max_k if isinstance(max_k, list) else [max_k] * n
    reqs = [RequestView(f"r{i}", 100 + i, proposer, caps[i], a, 0.1, **last) for i in range(n)]
    return BatchView(reqs, num_free_blocks=1000, block_size=16, scorers=list(SCORERS))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_builtin_decides_with_fresh_cost_models(name):
    policy = build_policy({"name": name})
    costs = CostModels()
    for n in (1, 8, 64):
        view = make_view(n, max_k=[8, 0] * (n // 2) + [8] * (n % 2))
        plan = policy.decide(view, costs)
        assert len(plan.k) == n and plan.scorer in SCORERS and plan.policy == name
        assert all(0 <= k <= r.max_k for k, r in zip(plan.k, view.requests, strict=True))
        assert plan.predicted_ms is not None and plan.predicted_ms > 0
        assert plan.expected_tokens is not None and plan.expected_tokens >= n
        assert {"predicted_score_ms", "predicted_propose_ms", "predicted_verify_ms"} <= set(plan.info)


def test_fixed_caps_by_request_max_k_and_fills_expected_tokens():
    plan = FixedPolicy(FixedConfig(k=2, scorer="batch_expansion")).decide(
        make_view(3, a=0.5, max_k=[5, 1, 0]), None
    )
    assert plan.k == [2, 1, 0] and plan.scorer == "batch_expansion"
    assert plan.expected_tokens == pytest.approx(1.75 + 1.5 + 1.0)  # (1 + .5 + .25) + (1 + .5) + 1
    assert plan.predicted_ms is None  # no cost models given


def test_fixed_rejects_unavailable_scorer_and_bad_config():
    with pytest.raises(ValueError, match="mqa_graph.*not available.*batch_expansion, mqa"):
        FixedPolicy(FixedConfig(scorer="mqa_graph")).decide(make_view(1), None)
    with pytest.raises(ValueError, match="k must be >= 0"):
        FixedConfig(k=-1)


def test_threshold_switches_scorer_at_batch_size():
    policy = ThresholdPolicy(ThresholdConfig(batch_size=4, k=3))
    small, large = policy.decide(make_view(3), CostModels()), policy.decide(make_view(4), CostModels())
    assert small.scorer == "batch_expansion" and large.scorer == "mqa"
    assert small.k == [3] * 3 and large.k == [3] * 4
    with pytest.raises(ValueError, match="batch_size"):
        ThresholdConfig(batch_size=0)


def test_disable_by_batch_turns_speculation_off():
    policy = DisableByBatchPolicy(DisableByBatchConfig(batch_size=4, k=2))
    assert policy.decide(make_view(3), None).k == [2, 2, 2]
    off = policy.decide(make_view(4), CostModels())
    assert off.k == [0] * 4 and off.info["is_disabled"]
    assert off.expected_tokens == pytest.approx(4.0)


def test_hf_next_k_schedule():
    assert hf_next_k(5, 5, 5) == 7  # all accepted: +2
    assert hf_next_k(5, 5, 2) == 4  # a rejection: -1
    assert hf_next_k(1, 1, 0) == 1  # never below 1
    assert hf_next_k(5, 0, 0) == 5  # no drafts last step: unchanged


def test_hf_heuristic_per_request_over_steps():
    policy = HfHeuristicPolicy(HfHeuristicConfig(initial_k=3, max_k=6))
    view = make_view(2, max_k=[8, 0], proposer="ngram")
    assert policy.decide(view, None).k == [3, 0]  # the n-gram request without a match gets 0
    view = make_view(2, max_k=[8, 8], proposer="ngram")
    view.requests[0].last_k, view.requests[0].last_accepted = 3, 3  # all accepted
    assert policy.decide(view, None).k == [5, 3]  # request 1 did not draft: keeps its schedule
    view.requests[0].last_k, view.requests[0].last_accepted = 5, 5
    assert policy.decide(view, None).k == [6, 3]  # capped at max_k = 6
    view.requests[0].last_k, view.requests[0].last_accepted = 6, 1
    view.requests[1].last_k, view.requests[1].last_accepted = 3, 0
    assert policy.decide(view, None).k == [5, 2]
    with pytest.raises(ValueError, match="initial_k"):
        HfHeuristicConfig(initial_k=0)
