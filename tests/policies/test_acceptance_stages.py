"""Two acceptance rates per request (policies/acceptance_stages.py): counted from the same steps as the
single rate, read lazily, and planned with by goodput's ``staged_acceptance``."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specsched.policies.acceptance import AcceptanceEstimator
from specsched.policies.acceptance_stages import staged_powers, staged_survival, stages_of
from specsched.policies.base import BatchView, RequestView
from specsched.policies.cost_model import CostModels
from specsched.policies.goodput import GoodputConfig, GoodputPolicy

STEPS = {"r0": [(8, 0), (8, 3), (8, 8), (0, 0)], "r1": [(2, 1)]}  # (k, accepted) per step


def fed(steps=STEPS) -> AcceptanceEstimator:
    est = AcceptanceEstimator()
    stages_of(est)
    for rid, obs in steps.items():
        for k, n in obs:
            est.observe(rid, "ngram", k, n)
    return est


def test_the_stages_count_the_first_draft_and_the_later_ones_from_the_same_steps():
    """Draft 1 is one trial of a1 per drafting step; each later draft reached is one trial of a2 (a
    truncated-geometric observation of accepted - 1 of k - 1). The counts wait until read."""
    est = fed()
    stages = est.stages
    assert len(stages.pending) == 4  # the k = 0 step teaches nothing
    first, rest = AcceptanceEstimator(), AcceptanceEstimator()
    for rid, k, n in [("r0", 8, 0), ("r0", 8, 3), ("r0", 8, 8), ("r1", 2, 1)]:
        first.observe(rid, "ngram", 1, min(n, 1))
        if n:
            rest.observe(rid, "ngram", k - 1, n - 1)
    m1, s1, m2, s2 = stages.mean_std_many(["r0", "r1", "new"], "ngram")
    assert stages.pending == []
    want1 = first.mean_std_many(["r0", "r1", "new"], "ngram")
    want2 = rest.mean_std_many(["r0", "r1", "new"], "ngram")
    np.testing.assert_allclose(np.stack([m1, s1], 1), want1)
    np.testing.assert_allclose(np.stack([m2, s2], 1), want2)
    assert stages.first._requests["r0"] == [2.0, 1.0] and stages.rest._requests["r0"] == [9.0, 1.0]
    est.forget("r1")  # in order with the observations
    est.observe("r1", "ngram", 1, 0)
    stages.flush()
    assert stages.first._requests["r1"] == [0.0, 1.0] and "r1" not in stages.rest._requests


def test_staged_survival_is_a1_times_a2_to_the_j_minus_1():
    p = staged_powers(np.array([0.5, 0.7]), np.array([0.9, 0.7]), np.array([0.0, 0.0]), 4)
    np.testing.assert_allclose(p[0], [0.5, 0.45, 0.405, 0.3645])
    np.testing.assert_allclose(p[1], 0.7 ** np.arange(1, 5))  # a1 = a2: the single-rate model


def test_the_batch_1_survival_in_python_is_the_numpy_row():
    """The single-request path (plain Python) gives each request's row of the batch path exactly, for fresh
    random posteriors (sd 0 and sds too wide for a Beta of that mean included)."""
    rng = np.random.default_rng(0)
    m1, m2 = rng.uniform(0, 1, 200), rng.uniform(0, 1, 200)
    s2 = np.concatenate([rng.uniform(0, 0.3, 180), np.zeros(10), np.full(10, 0.9)])
    rows = staged_powers(m1, m2, s2, 8)
    for i in range(200):
        got = staged_survival(float(m1[i]), float(m2[i]), float(s2[i]), 8)
        assert got == rows[i].tolist()  # bit for bit: the same products in the same order
    assert staged_survival(0.5, 0.9, 0.0, 1) == [0.5]
    est = fed()
    m1, s1, m2, s2 = est.stages.mean_std_many(["r0"], "ngram")
    assert est.stages.mean_std("r0", "ngram") == pytest.approx((m1[0], s1[0], m2[0], s2[0]))


def view(acc, est: AcceptanceEstimator | None, max_k=8) -> BatchView:
    reqs = [RequestView(f"r{i}", 200, "ngram", max_k, a, 0.05) for i, a in enumerate(acc)]
    return BatchView(reqs, 100000, 16, ["batch_expansion", "mqa"], acceptance=est)


@pytest.mark.parametrize("batch", [1, 3])
def test_goodput_plans_with_the_staged_survival_by_default(batch):
    """With ``staged_acceptance`` the search values a plan at Σ_i 1 + Σ_{j<=k_i} E[a1]·E[a2^(j-1)]
    from the estimator's two posteriors (batch 1: the single-request search, else the batch one):
    its goodput x predicted ms (the default); with ``staged_acceptance=False``, or without an
    estimator in the view, the single rate's.
    (The plan's ``expected_tokens`` stays the single rate's plug-in, as every policy reports it.)"""
    rng = random.Random(batch)
    steps = {f"r{i}": [(8, rng.choice([0, 0, 7, 8])) for _ in range(12)] for i in range(batch)}
    est = fed(steps)
    acc = [est.mean(f"r{i}", "ngram") for i in range(batch)]
    costs = CostModels()
    cfg = dict(acceptance_z=0.0, dither_interval=0)
    plan = GoodputPolicy(GoodputConfig(**cfg)).decide(view(acc, est), costs)  # two rates: the default
    m1, _, m2, s2 = est.stages.mean_std_many([f"r{i}" for i in range(batch)], "ngram")
    surv = staged_powers(m1, m2, s2, 8)

    def staged(k):
        return sum(1.0 + surv[i, :ki].sum() for i, ki in enumerate(k))

    assert any(plan.k)
    assert plan.info["goodput"] * plan.predicted_ms == pytest.approx(staged(plan.k))
    single = GoodputPolicy(GoodputConfig(staged_acceptance=False, **cfg)).decide(view(acc, est), costs)
    no_est = GoodputPolicy(GoodputConfig(staged_acceptance=True, **cfg)).decide(view(acc, None), costs)
    assert single.info["goodput"] == pytest.approx(no_est.info["goodput"])
    assert single.info["goodput"] * single.predicted_ms != pytest.approx(staged(single.k))


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_an_engine_on_staged_goodput_is_lossless_and_feeds_the_stages(proposer):
    from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
    from specsched.engine.engine import Engine
    from specsched.engine.request import SamplingParams

    def engine(policy: dict, prop: str) -> Engine:
        return Engine(
            EngineConfig(
                model=ModelConfig(source="tiny", dtype="float32"),
                cache=CacheConfig(block_size=4, num_blocks=256),
                scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                spec=SpecConfig(proposer=prop, max_k=4),
                policy=policy,
            )
        )

    rng = random.Random(7)
    motif = [rng.randrange(3, 256) for _ in range(5)]
    prompts = [(motif * 6)[: rng.randint(8, 30)] for _ in range(5)]  # n-gram food
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    spec = engine({"name": "goodput", "staged_acceptance": True}, proposer)
    out = spec.generate(prompts, params)
    assert out == engine({"name": "fixed", "k": 0}, "none").generate(prompts, params)
    stages = spec.acceptance.stages
    assert stages is not None
    stages.flush()
    assert sum(stages.first._aggregate.get(proposer, [0, 0])) > 0  # drafting steps reached the stages
