"""``goodput`` at k = 0: a step where no request speculates is a plain decode step, and it runs on
the scorer predicted cheapest for one (the batch-expansion decode graph on CUDA), whatever scorer
the speculative steps before it used (issue 13: k = 0 steps stayed on the MQA graph)."""

from __future__ import annotations

import pytest

from specsched.policies.base import BatchView, RequestView
from specsched.policies.cost_model import CostModels
from specsched.policies.goodput import GoodputPolicy
from specsched.policies.sim_machine import LADDER, Machine, ScorerCost
from specsched.policies.simulate import Scenario, simulate

SCORERS = ["batch_expansion", "mqa_graph"]


def view(acceptance: float, batch: int = 1) -> BatchView:
    reqs = [RequestView(f"r{i}", 300, "draft", 8, acceptance, 0.01) for i in range(batch)]
    return BatchView(reqs, num_free_blocks=10000, block_size=16, scorers=SCORERS)


def mature_costs(be_k0: float, mqa_k0: float, batch: int = 1) -> CostModels:
    """Hand-set CUDA models, as after many steps: batch expansion pays 0.02 ms per scored row, the
    MQA graph 0.002 ms per token, so MQA wins once requests draft; a plain decode step of ``batch``
    requests scores in ``be_k0`` and ``mqa_k0`` ms."""
    costs = CostModels({s: list(LADDER) for s in SCORERS}, device="cuda")
    for name, coef in {"batch_expansion": [be_k0 - 0.02 * batch, 0.02, 0.0, 0.0, 0.0, 0.0],
                       "mqa_graph": [mqa_k0 - 0.002 * batch, 0.0, 0.002, 0.0, 0.0, 0.0]}.items():  # fmt: skip
        model = costs.model("score", name)
        model.coef, model.num_updates = coef, 1000
        costs.num_decodes[name] = 100  # both seen at k = 0: nothing to try
    for key, coef in {("propose", "draft"): [0.05, 0.05, 0.0, 0.0], ("verify",): [0.05, 0.0],
                      ("overhead",): [0.2, 0.0]}.items():  # fmt: skip
        model = costs.model(*key)
        model.coef, model.num_updates = coef, 1000
    return costs


@pytest.mark.parametrize("batch", [1, 8])
def test_k0_step_leaves_the_speculative_scorer_for_the_cheaper_decode(batch):
    # batch expansion's plain decode is 1% cheaper: inside the 2% scorer hysteresis of the speculative
    # choice, which kept the MQA graph for the k = 0 steps
    costs = mature_costs(be_k0=1.089, mqa_k0=1.1, batch=batch)
    policy = GoodputPolicy()
    for _ in range(2):
        spec = policy.decide(view(0.9, batch), costs)
        assert spec.scorer == "mqa_graph" and min(spec.k) > 0
        off = policy.decide(view(0.001, batch), costs)
        assert off.k == [0] * batch
        assert off.scorer == "batch_expansion", off.info
        assert off.info["is_decode_scorer"]
        # speculation resumes on the scorer the speculative steps chose: no hysteresis against it
        assert policy.decide(view(0.9, batch), costs).scorer == "mqa_graph"


def test_k0_step_stays_when_the_speculative_scorer_decodes_cheaper():
    costs = mature_costs(be_k0=1.2, mqa_k0=1.1)
    policy = GoodputPolicy()
    policy.decide(view(0.9), costs)
    off = policy.decide(view(0.001), costs)
    assert off.k == [0] and off.scorer == "mqa_graph"


def smollm2_like() -> Machine:
    """A launch-bound H200 as measured for SmolLM2 (2026-12-03): a plain decode 1.14 ms on the
    batch-expansion graph, 1.20 ms on the MQA graph."""
    return Machine(
        "smollm2-like",
        {
            "batch_expansion": ScorerCost(1.13, row_ms=0.01, is_expansion=True, buckets=LADDER, eager_ms=8.0),
            "mqa_graph": ScorerCost(1.19, token_ms=0.004, buckets=LADDER, eager_ms=8.0),
        },
        draft_forward_ms=0.3,
        verify_bias_ms=0.05,
        overhead_ms=0.2,
    )


def test_an_unseen_decode_graph_is_tried_at_k0():
    """A self-draft that is never accepted: goodput turns speculation off. The batch-expansion
    model, never observed, sits at the cuda seed (~8 ms, seeded for a 7B model) while the MQA
    graph's has learnt ~1.2 ms; the seeds rank the two alike, so the k = 0 steps try the young one,
    learn it is cheaper, and decode on it from then on."""
    sc = Scenario(smollm2_like(), 0.01, 1, "draft", num_steps=300, output_len=200, noise=0.02)
    k0_scorers = []

    def on_step(step, view, plan, rec):
        if step >= 100 and not any(plan.k):
            k0_scorers.append(plan.scorer)

    simulate(GoodputPolicy(), sc, on_step=on_step)
    assert len(k0_scorers) > 150
    assert k0_scorers.count("batch_expansion") / len(k0_scorers) > 0.95
