"""goodput weighs runs of plain decode steps (``scheduler.decode_steps``): a plan that drafts nothing
runs S forwards for one host round trip, so its tokens cost less than a single plain step's."""

from __future__ import annotations

import pytest

from specsched.engine.records import StepRecord, StepRequestRecord
from specsched.policies.base import BatchView, RequestView
from specsched.policies.cost_model import CostModels
from specsched.policies.goodput import GoodputConfig, GoodputPolicy
from specsched.policies.run_cost import CatchUpCost, plain_stats, weigh_run

SCORERS = ["batch_expansion", "mqa", "mqa_graph"]
BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def cuda_costs() -> CostModels:
    return CostModels({"mqa_graph": BUCKETS, "batch_expansion": BUCKETS}, device="cuda")


def view(batch: int, a: float, decode_steps: int, std: float = 0.01) -> BatchView:
    reqs = [RequestView(f"r{i}", 300, "draft", 8, a, std) for i in range(batch)]
    return BatchView(reqs, 100_000, 16, SCORERS, 0, decode_steps)


def quiet() -> GoodputPolicy:
    """goodput without probes or dither (a deterministic plan from the estimates)."""
    return GoodputPolicy(GoodputConfig(acceptance_z=0, dither_interval=0))


def test_predict_run_is_s_forwards_and_one_round_trip():
    costs = cuda_costs()
    s = plain_stats([300] * 8)
    one = costs.predict_stats("mqa_graph", "none", s)
    for steps in (1, 4):
        want = steps * one.score_ms + one.verify_ms + one.overhead_ms
        assert costs.predict_run("mqa_graph", s, steps) == pytest.approx(want)
    assert costs.predict_run("mqa_graph", s, 1) == pytest.approx(one.total_ms)  # k = 0: no propose


def run_record(step: int, batch: int, steps: int, total_ms: float) -> StepRecord:
    rec = StepRecord(step, "decode", 0.0, batch, batch * steps)
    rec.requests = [StepRequestRecord(f"r{i}", 299, 0, 0, "", steps, 0) for i in range(batch)]
    rec.scorer, rec.num_decode_steps, rec.total_ms = "mqa_graph", steps, total_ms
    return rec


def test_runs_teach_their_own_ratio_and_not_the_step_models():
    costs = cuda_costs()
    s = plain_stats([300] * 4)
    predicted = costs.predict_run("mqa_graph", s, 4)
    coef = costs.model("score", "mqa_graph").coef.copy()
    for i in range(40):
        assert costs.observe(run_record(i, 4, 4, 2.0 * predicted)) is False  # not one step's cost
    assert costs.predict_run("mqa_graph", s, 4) == pytest.approx(2.0 * predicted, rel=1e-6)
    assert (costs.model("score", "mqa_graph").coef == coef).all()
    assert "mqa_graph" not in costs.num_decodes
    assert costs.num_run_steps == {"mqa_graph": 160}  # 40 runs of 4: what ends a decode try


def test_a_decode_try_ends_after_its_runs():
    """The MQA graph priced within the tolerance of the decode graph but never seen at k = 0 is tried
    for plain steps; runs on it count as its plain steps, so the tries end after min_steps of them."""
    from specsched.policies.goodput_explore import decode_scorer

    costs = cuda_costs()
    scorers = ["batch_expansion", "mqa_graph"]
    for name in scorers:  # both models mature; only batch expansion has seen plain steps
        costs.model("score", name).num_updates = 100
    costs.num_decodes["batch_expansion"] = 100
    goodput_k0 = [10.0, 9.8]  # the MQA graph within 5 % of the best
    assert decode_scorer(costs, scorers, goodput_k0, [300] * 4, 8, 0.05) == (1, True)
    costs.observe(run_record(0, 4, 4, 1.0))
    assert decode_scorer(costs, scorers, goodput_k0, [300] * 4, 8, 0.05) == (1, True)  # 4 steps seen
    costs.observe(run_record(1, 4, 4, 1.0))
    assert decode_scorer(costs, scorers, goodput_k0, [300] * 4, 8, 0.05) == (0, False)  # 8: tried enough


def spec_record(step: int, batch: int, k: int, propose_ms: float, is_after_run: bool) -> StepRecord:
    rec = StepRecord(step, "decode", 0.0, batch, batch * (k + 1))
    rec.requests = [StepRequestRecord(f"r{i}", 299, k, k // 2, "", k // 2 + 1, k) for i in range(batch)]
    rec.scorer, rec.proposer, rec.is_after_run = "mqa_graph", "draft", is_after_run
    rec.propose_ms, rec.score_ms, rec.verify_ms = propose_ms, 0.5, 0.05
    rec.total_ms = propose_ms + 0.5 + 0.05 + 0.2
    return rec


def test_a_catch_up_after_a_run_does_not_teach_the_propose_model():
    costs = cuda_costs()
    for step in range(40):  # models that know these steps (a long catch-up would look like a stall)
        costs.observe(spec_record(step, 4, 3, 0.4, False))
    propose = costs.model("propose", "draft").coef.copy()
    score = costs.model("score", "mqa_graph").coef.copy()
    num_errors = costs.errors["mqa_graph"].count
    assert costs.observe(spec_record(40, 4, 3, 40.0, True)) is True  # a catch-up is no stall
    assert costs.num_stalls == 0
    assert (costs.model("propose", "draft").coef == propose).all()
    assert not (costs.model("score", "mqa_graph").coef == score).all()  # the rest of the step teaches
    assert costs.errors["mqa_graph"].count == num_errors  # nor the prequential error
    assert costs.observe(spec_record(41, 4, 3, 2.0, False))  # slower drafts not after a run: learnt
    assert not (costs.model("propose", "draft").coef == propose).all()


def test_weigh_run_hysteresis():
    costs = cuda_costs()
    ctx = [300] * 8
    g_run = weigh_run(costs, "mqa_graph", ctx, 4, None, False, 0.02).goodput
    assert g_run > 0
    assert not weigh_run(costs, "mqa_graph", ctx, 4, None, False, 0.02).is_taken  # nothing to replace
    assert weigh_run(costs, "mqa_graph", ctx, 4, g_run * 0.9, False, 0.02).is_taken
    assert not weigh_run(costs, "mqa_graph", ctx, 4, g_run * 0.99, False, 0.02).is_taken  # within margin
    assert weigh_run(costs, "mqa_graph", ctx, 4, g_run * 1.01, True, 0.02).is_taken  # held after a run
    assert not weigh_run(costs, "mqa_graph", ctx, 4, g_run * 1.05, True, 0.02).is_taken


@pytest.mark.parametrize("batch,a", [(1, 0.2), (8, 0.3), (64, 0.5)])
def test_a_plan_that_speculates_one_step_at_a_time_runs_when_runs_pay(batch, a):
    costs = cuda_costs()
    single = quiet().decide(view(batch, a, 1), costs)
    assert max(single.k) > 0  # one plain step at a time, speculating pays (a little)
    plan = quiet().decide(view(batch, a, 4), costs)
    assert plan.k == [0] * batch
    assert plan.info["is_run"] and plan.info["reason"].startswith("run of 4 plain steps")
    assert plan.info["run_goodput"] > single.info["goodput"]
    assert plan.expected_tokens == batch * 4
    assert plan.predicted_ms == pytest.approx(costs.predict_run(plan.scorer, plain_stats([300] * batch), 4))


def test_high_acceptance_still_speculates_with_runs_on():
    plan = quiet().decide(view(8, 0.8, 4), cuda_costs())
    assert max(plan.k) > 0 and plan.info["is_run"] is False
    assert plan.info["run_goodput"] < plan.info["goodput"]


def test_a_probe_keeps_its_drafts():
    costs = cuda_costs()
    policy = GoodputPolicy(GoodputConfig(acceptance_z=2.0, dither_interval=0))
    young = view(8, 0.1, 4, std=0.25)  # a wide posterior: the first decide probes at a + 2 sd
    assert quiet().decide(young, costs).k == [0] * 8  # at the mean it drafts nothing
    plan = policy.decide(young, costs)
    assert plan.info["is_probe"]
    assert max(plan.k) > 0 and plan.info["is_run"] is False


def test_runs_off_leave_the_plan_as_it_was():
    costs = cuda_costs()
    plan = quiet().decide(view(8, 0.3, 1), costs)
    assert "run_goodput" not in plan.info and max(plan.k) > 0


def test_a_catch_up_is_kept_as_the_proposers_switch_cost():
    costs = cuda_costs()
    for step in range(40):
        costs.observe(spec_record(step, 4, 3, 0.4, False))
    assert costs.catchup_ms("draft") == 0.0  # none seen yet
    predicted = costs.model("propose", "draft").predict([1.0, 3, 12, 12])
    costs.observe(spec_record(40, 4, 3, 9.0, True))
    assert costs.catchup_ms("draft") == pytest.approx(9.0 - predicted, rel=1e-6)
    costs.observe(spec_record(41, 4, 3, 5.0, True))  # a running mean of the excess
    assert costs.catchup_ms("draft") == pytest.approx((9.0 + 5.0) / 2 - predicted, rel=1e-6)
    assert costs.catchup_ms("ngram") == 0.0  # a proposer never seen after plain steps costs nothing
    costs.seed_defaults("cuda")
    assert costs.catchup_ms("draft") == 0.0


def test_weigh_run_enters_a_run_once_the_passed_up_savings_pay_for_the_way_back():
    costs = cuda_costs()
    ctx = [300] * 8
    free = weigh_run(costs, "mqa_graph", ctx, 4, None, False, 0.02)
    g_spec = free.goodput / 1.05  # the run predicted 5 % better
    saved = 8 * 4 / g_spec - free.ms  # what one passed-up run would have saved
    assert weigh_run(costs, "mqa_graph", ctx, 4, g_spec, False, 0.02).is_taken  # a free switch: at once
    regret = 0.0
    for i in range(3):  # the way back costs 2.5 runs' savings: the third decide in a row takes the run
        choice = weigh_run(costs, "mqa_graph", ctx, 4, g_spec, False, 0.02, 2.5 * saved, regret)
        assert choice.is_taken == (i == 2)
        regret = choice.regret_ms
        assert regret == (0.0 if i == 2 else pytest.approx((i + 1) * saved))
    # a decide where speculation holds starts the account over
    held = weigh_run(costs, "mqa_graph", ctx, 4, free.goodput, False, 0.02, 2.5 * saved, 2 * saved)
    assert not held.is_taken and held.regret_ms == 0.0
    # in runs, no charge: speculation takes over only when margin better
    assert weigh_run(costs, "mqa_graph", ctx, 4, free.goodput * 1.01, True, 0.02, 1e9).is_taken
    assert weigh_run(costs, "mqa_graph", ctx, 4, None, False, 0.02, 1.0, 3.0).regret_ms == 3.0  # no spec plan


@pytest.mark.parametrize("batch,a", [(8, 0.3), (64, 0.5)])
def test_a_measured_catch_up_delays_runs_until_they_have_paid_for_it(batch, a):
    costs = cuda_costs()
    assert quiet().decide(view(batch, a, 4), costs).info["is_run"]  # runs lead (the test above)
    run_ms = costs.predict_run("mqa_graph", plain_stats([300] * batch), 4)
    costs.catchups["draft"] = CatchUpCost(value=0.5 * run_ms, num_steps=1)  # a dear way back
    policy = quiet()
    plans = [policy.decide(view(batch, a, 4), costs) for _ in range(40)]
    first = next(i for i, p in enumerate(plans) if p.info["is_run"])
    assert first > 0 and max(plans[0].k) > 0  # speculating while the passed-up runs add up
    assert 0 < plans[0].info["run_regret_ms"] < plans[0].info["run_switch_ms"]
    assert all(p.info["is_run"] for p in plans[first:])  # then in runs, and it stays
    costs.catchups["draft"].value = 0.0  # a proposer whose catch-up is free: runs at once
    assert quiet().decide(view(batch, a, 4), costs).info["is_run"]
