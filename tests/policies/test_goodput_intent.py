"""goodput's plan intent (``info["k_intent"]``): the k each request would take were it offered every
draft, which the engine's carry uses instead of a k the step's offer cut short."""

from __future__ import annotations

import numpy as np

from specsched.engine.planning import carry_plan
from specsched.policies.base import BatchView, Plan, RequestView
from specsched.policies.cost_model import CostModels
from specsched.policies.goodput import GoodputPolicy
from specsched.policies.goodput_search import BatchProblem, acceptance_powers

SCORERS = ["mqa"]


def cheap_draft_costs() -> CostModels:
    """Eager MQA: 1 ms a step, 0.01 ms a token; a proposer that costs nothing (n-gram)."""
    costs = CostModels({}, device="cuda")
    for key in [("score", "mqa"), ("propose", "ngram"), ("verify",), ("overhead",)]:
        costs.model(*key).coef = np.zeros(costs.model(*key).num_features)
    score = costs.model("score", "mqa").coef
    score[0], score[2] = 1.0, 0.01  # intercept, per token (features: policies/shapes.py)
    return costs


def problem(mean, cap, std=0.01):
    n = len(mean)
    return BatchProblem(
        cheap_draft_costs(), SCORERS, "ngram", np.array(mean, float), np.full(n, std), np.full(n, 100),
        np.array(cap), 3, 0.02,
    )  # fmt: skip


def test_intent_extends_only_requests_held_at_their_cap_by_the_drafts_that_pay():
    prob = problem([0.95, 0.95, 0.02, 0.6], [2, 8, 2, 8])
    k = prob.best_k[0]
    assert k[0] == 2 and k[2] == 0 and k[3] < 8, k  # a capped, c not worth a draft, d below its cap
    lam = prob.best_goodput[0]
    intent = prob.intent(k, lam, 0, 8)
    powers = acceptance_powers(np.array([0.95]), np.array([0.01]), 8)[0]
    kstar = int((powers > lam * prob.table.delta[0, 0]).sum())
    assert kstar > 2
    assert intent == [kstar, int(k[1]), 0, int(k[3])]  # only a (at its cap 2) changes
    # nothing at a cap below max_k: the plan is its own intent
    assert prob.intent(np.array([1, 3, 0, 2]), lam, 0, 8) is None


def test_intent_keeps_the_plan_s_k_where_the_drafts_do_not_pay():
    prob = problem([0.05, 0.05], [1, 1])
    k = np.array([1, 0])
    assert prob.intent(k, prob.best_goodput[0], 0, 8) == [1, 0]  # never below the plan's k


def test_goodput_records_the_intent_and_the_carry_drafts_it_when_the_offer_grows():
    caps, accs = [2, 8, 2, 8], [0.95, 0.95, 0.95, 0.6]
    reqs = [RequestView(f"r{i}", 100, "ngram", c, a, 0.01) for i, (c, a) in enumerate(zip(caps, accs))]
    view = BatchView(reqs, 1 << 20, 16, SCORERS, 0)
    plan = GoodputPolicy().decide(view, cheap_draft_costs())
    intent = plan.info["k_intent"]
    assert plan.k[0] == 2 and intent[0] > 2 and intent[1] == plan.k[1]
    # the next step the offers moved: r0's match grew to 8, r1's shrank to 1, r2 has none now
    later = BatchView(
        [RequestView(r.request_id, 101, "ngram", c, r.acceptance, 0.01) for r, c in zip(reqs, [8, 1, 0, 8])],
        1 << 20, 16, SCORERS, 1,
    )  # fmt: skip
    ids = [r.request_id for r in reqs]
    got = carry_plan(ids, plan, later, None, {r.request_id: r.max_k for r in reqs})
    assert got.k == [intent[0], 1, 0, min(intent[3], 8)]
    assert "k_intent" not in got.info and plan.info["k_intent"] == intent  # not logged with each carry
    # without the intent the carry keeps r0 at the k its old offer allowed
    info = {key: v for key, v in plan.info.items() if key != "k_intent"}
    bare = Plan(plan.k, plan.scorer, plan.policy, info=info)
    assert carry_plan(ids, bare, later, None, {r.request_id: r.max_k for r in reqs}).k[0] == 2


def test_a_joined_request_takes_the_intent_of_its_nearest_kept_request():
    plan = Plan([2, 0], "mqa", "goodput", info={"k_intent": [6, 0]})
    view = BatchView(
        [RequestView("a", 10, "ngram", 8, 0.9, 0.1), RequestView("b", 10, "ngram", 8, 0.1, 0.1),
         RequestView("c", 10, "ngram", 8, 0.85, 0.1)],
        100, 4, SCORERS, 0,
    )  # fmt: skip
    got = carry_plan(["a", "b"], plan, view, 1.0, {"a": 2, "b": 0})
    assert got.k == [6, 0, 6] and got.info["num_reopened"] == 0  # b's intent 0: not reopened
