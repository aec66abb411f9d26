"""The fast paths' parts against straightforward references: the plan evaluator against the cost
table, the incremental pool sums against :func:`pool_strength`, the inlined posterior lookup, the
plain-Python RLS step against its numpy formula, a decode record's stats against ``StepShape``."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specsched.engine.records import StepRecord, StepRequestRecord
from specsched.policies.acceptance import AcceptanceConfig, AcceptanceEstimator, pool_strength
from specsched.policies.cost_model import CostModels
from specsched.policies.cost_table import CostTable
from specsched.policies.goodput_eval import PlanEvaluator
from specsched.policies.goodput_search import acceptance_powers, expected_table
from specsched.policies.rls import OnlineLinearModel
from specsched.policies.shapes import StepShape, score_features
from specsched.policies.step_cost import record_stats

SCORERS = ["batch_expansion", "mqa", "mqa_graph"]


def random_costs(rng: np.random.Generator, negative: bool) -> CostModels:
    buckets = {
        "batch_expansion": sorted(set(rng.integers(1, 300, rng.integers(1, 12)).tolist())),
        "mqa_graph": sorted(set(rng.integers(1, 300, rng.integers(1, 12)).tolist())),
    }
    costs = CostModels(buckets, device="cuda")
    for key in [("score", s) for s in SCORERS] + [("propose", "draft"), ("verify",), ("overhead",)]:
        m = costs.model(*key)
        coef = rng.uniform(0.0, 2.0, m.num_features) * rng.choice([1.0, 0.01], m.num_features)
        if negative:
            coef[rng.integers(m.num_features)] *= -20.0
        m.coef = coef
    return costs


@pytest.mark.parametrize("negative", [False, True])
def test_plan_evaluator_equals_the_cost_table_bit_for_bit(negative):
    rng = np.random.default_rng(11 + negative)
    for _ in range(40):
        costs = random_costs(rng, negative)
        b = int(rng.integers(1, 40))
        ctx, cap = rng.integers(1, 4000, b), rng.integers(0, 9, b)
        powers = acceptance_powers(rng.uniform(0, 1, b), rng.uniform(0.01, 0.3, b), max(int(cap.max()), 1))
        ecum = expected_table(powers)
        table = CostTable(costs, SCORERS, "draft", ctx, b + int(cap.sum()))
        ev = PlanEvaluator(table, ecum, ctx)
        k = np.minimum(rng.integers(0, 9, (4, b)), cap)  # [C, B] candidates within the caps
        want = ecum[np.arange(b), k].sum(-1) / np.maximum(table.total_ms(k), 1e-9)  # [S, C]
        assert np.array_equal(ev.many(k), want)
        stacked = np.stack([k] * len(SCORERS))  # [S, C, B]
        assert np.array_equal(ev.many(stacked, ev.expected(stacked)), want)
        for s in range(len(SCORERS)):
            for c in range(len(k)):
                assert ev.one(k[c], s) == want[s, c]
                assert ev.components(k[c].tolist(), s) == table.components(k[c], s)


def walk(rng: random.Random, a: float, k: int) -> int:
    n = 0
    while n < k and rng.random() < a:
        n += 1
    return n


@pytest.mark.parametrize("decay", [1.0, 0.97])
def test_pool_sums_follow_the_pool(decay):
    """The strength from the running sums equals :func:`pool_strength` over the pool's counts summed
    afresh, through observations, finished requests, a pool that rolls over and a proposer switch."""
    rng = random.Random(5)
    est = AcceptanceEstimator(AcceptanceConfig(request_decay=decay, pool_requests=8, min_pool_requests=2))
    live = {f"r{i}": ("draft", rng.random()) for i in range(12)}
    num = len(live)
    for step in range(300):
        for rid, (proposer, a) in list(live.items()):
            if rng.random() < 0.02:
                proposer = "ngram" if proposer == "draft" else "draft"
                live[rid] = (proposer, a)
            k = rng.randint(0, 6)
            est.observe(rid, proposer, k, walk(rng, a, k))
            if rng.random() < 0.05:
                est.forget(rid)
                del live[rid]
                live[f"r{num}"], num = ("draft", rng.random()), num + 1
        for proposer in ("draft", "ngram"):
            counts = list(est._finished.get(proposer, ()))
            counts += [tuple(c) for r, c in est._requests.items() if est._proposer_of[r] == proposer]
            fresh = pool_strength(counts) if sum(1 for s, f in counts if s + f > 0) >= 2 else None
            want = est.config.prior_strength if fresh is None else min(fresh, est.config.max_prior_strength)
            assert est.prior_strength(proposer) == pytest.approx(want, rel=1e-9), step


def test_mean_std_is_the_posterior():
    rng = random.Random(2)
    est = AcceptanceEstimator()
    for i in range(30):
        for _ in range(rng.randint(0, 20)):
            k = rng.randint(1, 5)
            est.observe(f"r{i}", "draft", k, walk(rng, 0.6, k))
    for i in range(32):  # two never observed
        mean, std = est.mean_std(f"r{i}", "draft")
        assert (mean, std) == (est.mean(f"r{i}", "draft"), est.std(f"r{i}", "draft"))


def reference_rls(m: OnlineLinearModel, x: np.ndarray, y: float) -> tuple[np.ndarray, np.ndarray]:
    """The RLS step of :class:`OnlineLinearModel` in numpy (Haykin Table 9.1, capped diagonal)."""
    lam, cov, coef = m.forgetting, m.cov, m.coef
    px = cov @ x
    gain = px / (lam + x @ px)
    coef = coef + gain * (y - coef @ x)
    cov = (cov - np.outer(gain, px)) / lam
    cov = (cov + cov.T) * 0.5
    diag = cov.diagonal()
    if (diag > m.prior_var).any():
        scale = np.sqrt(np.minimum(1.0, m.prior_var / np.maximum(diag, 1e-300)))
        cov = cov * np.outer(scale, scale)
    return coef, cov


def test_rls_step_equals_its_numpy_formula():
    rng = np.random.default_rng(4)
    for features in (2, 4, 6):
        m = OnlineLinearModel(
            features, 0.98, prior_var=rng.uniform(1, 100, features), coef=rng.normal(size=features)
        )
        for step in range(200):
            x = np.concatenate([[1.0], rng.uniform(0, 50, features - 1)])
            if step % 3 == 0:
                x[-1] = 0.0  # a feature the data does not excite: its variance winds up to the cap
            y = float(rng.normal(5.0, 1.0))
            coef, cov = reference_rls(m, x, y)
            m.update(x.tolist(), y)
            assert m.coef == pytest.approx(coef, rel=1e-9, abs=1e-12)
            assert m.cov == pytest.approx(cov, rel=1e-9, abs=1e-12)
            assert np.array_equal(m.cov, m.cov.T)


def test_record_stats_and_score_features_equal_the_step_shape():
    rng = np.random.default_rng(6)
    buckets = np.array([1, 2, 4, 8, 16, 32, 64])
    for _ in range(50):
        b = int(rng.integers(1, 40))
        k, ctx = rng.integers(0, 9, b).tolist(), rng.integers(0, 3000, b).tolist()
        reqs = [StepRequestRecord(f"r{i}", c, ki, 0) for i, (ki, c) in enumerate(zip(k, ctx))]
        rec = StepRecord(0, "decode", 0.0, b, sum(k) + b, scorer="mqa", requests=reqs)
        want = StepShape(k, [c + 1 for c in ctx]).stats()
        assert record_stats(rec) == want
        for is_exp in (True, False):
            for bk in (None, buckets):
                arrays = type(want)(*(np.array([v]) for v in vars(want).values()))
                got, ref = score_features(want, is_exp, bk), score_features(arrays, is_exp, bk)
                assert got == [float(np.asarray(r).ravel()[0]) for r in ref]
