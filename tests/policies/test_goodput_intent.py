"""goodput's plan intent (``info["k_intent"]``): the k each request would take were it offered every
draft, which the engine's carry uses instead of a k the step's offer cut short."""

from __future__ import annotations

import numpy as np

from specsched.engine.carry import carry_plan
from specsched.policies.base import BatchView, Plan, RequestView
from specsched.policies.cost_model import CostModels
from specsched.policies.goodput import GoodputConfig, GoodputPolicy
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
    assert plan.info["acceptance"] == accs and "acceptance" not in got.info  # the decide's posteriors
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


GRAPH = ["mqa_graph"]


def graph_costs() -> CostModels:
    """An MQA graph scorer whose 64-token graph costs 0.32 ms more than its 32-token one (1 ms a
    step, 0.01 ms a padded token): four requests offered 8 drafts each (36 tokens) plan 7 each."""
    costs = CostModels({"mqa_graph": [4, 8, 16, 32, 64]}, device="cuda")
    for key in [("score", "mqa_graph"), ("propose", "ngram"), ("verify",), ("overhead",)]:
        costs.model(*key).coef = np.zeros(costs.model(*key).num_features)
    score = costs.model("score", "mqa_graph").coef
    score[0], score[2] = 1.0, 0.01
    return costs


def graph_view(caps, step=0, acceptance=(0.95, 0.95, 0.95, 0.95)) -> BatchView:
    reqs = [
        RequestView(f"r{i}", 100 + step, "ngram", c, a, 0.01)
        for i, (c, a) in enumerate(zip(caps, acceptance))
    ]
    return BatchView(reqs, 1 << 20, 16, GRAPH, step)


def test_a_graph_plan_carries_the_drafts_its_bucket_fit_cut_within_its_graph():
    """A plan decided ahead (every request offered max_k) fits the batch's tokens into a graph; at the
    step only some requests have an offer, and each of those takes the draft the fit cut (the H100
    serve log of 2026-12-06 at N = 4: (7, 7, 7, 7) carried to one offer ran k = 7 where k = 8 ran 8)."""
    plan = GoodputPolicy().decide(graph_view([8, 8, 8, 8]), graph_costs())
    assert plan.k == [7, 7, 7, 7], plan.k  # 32 tokens, not 36 in the 64-token graph
    assert plan.info["k_intent"] == [8, 8, 8, 8] and plan.info["token_budget"] == 32
    ids, caps = [f"r{i}" for i in range(4)], dict.fromkeys([f"r{i}" for i in range(4)], 8)
    carry = lambda offers: carry_plan(ids, plan, graph_view(offers, 1), None, caps).k  # noqa: E731
    assert carry([0, 0, 0, 8]) == [0, 0, 0, 8]
    assert carry([8, 0, 8, 8]) == [8, 0, 8, 8]  # 28 tokens
    assert carry([8, 8, 8, 8]) == [7, 7, 7, 7]  # the same offers: the plan, in its graph
    assert carry([8, 8, 3, 8]) == [8, 8, 3, 8]  # 31 tokens
    assert carry([8, 8, 6, 8]) == [7, 7, 6, 8]  # 34: two 8th drafts over (equal value: the first go)
    bare = Plan(plan.k, plan.scorer, plan.policy, info={})
    assert carry_plan(ids, bare, graph_view([0, 0, 0, 8], 1), None, caps).k == [0, 0, 0, 7]


def test_the_token_budget_trims_the_least_valuable_drafts_and_not_a_capped_request_s_growth():
    # r0 was held at its offer 2 (its intent 6 is an offer growing, taken as without a budget); r1-r3
    # were fit into the 24-token graph; carried, they are trimmed back to it, least valuable first
    plan = Plan([2, 3, 4, 4], "mqa_graph", "goodput", info={"k_intent": [6, 6, 6, 6], "token_budget": 24})
    reqs = [RequestView(f"r{i}", 100, "ngram", 8, a, 0.01) for i, a in enumerate([0.9, 0.5, 0.95, 0.9])]
    view = BatchView(reqs, 1 << 20, 16, GRAPH, 1)
    ids = [r.request_id for r in reqs]
    got = carry_plan(ids, plan, view, None, {"r0": 2, "r1": 8, "r2": 8, "r3": 8})
    # 4 + 6 + 6 + 6 + 6 = 28 tokens, 4 over: r1's drafts 6, 5, 4 (0.5^j) go first, then r3's 6th (0.9^6)
    assert got.k == [6, 3, 6, 5] and "token_budget" not in got.info
    # a budget below the floors: every trimmable request at its floor, r0's growth kept
    tight = Plan(plan.k, plan.scorer, plan.policy, info={**plan.info, "token_budget": 16})
    assert carry_plan(ids, tight, view, None, {"r0": 2, "r1": 8, "r2": 8, "r3": 8}).k == [6, 3, 4, 4]


def test_a_graph_plan_that_drafts_nothing_has_no_intent():
    """Two graphs, 4 and 64 tokens: one draft would move the step to the 64-token graph, which no
    draft at a = 0.3 pays for; linearised (0.01 ms a token) two drafts each would, so an intent
    there would stand in for drafts the plan's exact search refused."""
    costs = graph_costs()
    costs.graph_buckets["mqa_graph"] = np.array([4, 64])
    no_probe = GoodputPolicy(GoodputConfig(acceptance_z=0.0))  # a probe would try them
    plan = no_probe.decide(graph_view([8, 8, 8, 8], acceptance=(0.3,) * 4), costs)
    assert plan.k == [0, 0, 0, 0] and "k_intent" not in plan.info and "token_budget" not in plan.info
