"""The plain-Python search for small batches (policies/goodput_small.py) decides as the numpy one does,
bit for bit, method by method, on random cost models, posteriors, caps and graph buckets. One value is
equal to the last ulp or so only: the plan's reported expected tokens at the posterior means, a power
numpy vectorises (with AVX-512, its SIMD ``a ** n`` differs from libm's ``pow`` by up to 1 ulp: 4.8 %
of random pairs on this project's CPU machine, 2026-12-07); no decision reads it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specsched.policies.acceptance import AcceptanceEstimator
from specsched.policies.acceptance_stages import staged_powers, staged_rows, stages_of
from specsched.policies.base import BatchView, RequestView
from specsched.policies.goodput import GoodputConfig, GoodputPolicy
from specsched.policies.goodput_search import BatchProblem, improve, uniform_plans
from specsched.policies.goodput_small import MAX_EXACT_BATCH, SmallProblem

from .test_goodput_search import SCORERS, random_costs


def problems(rng: np.random.Generator, trial: int):
    """A random step's (numpy problem, plain-Python problem, the inputs)."""
    costs = random_costs(rng, negative=trial % 4 == 0)  # every 4th: the clipped path
    b = int(rng.integers(2, MAX_EXACT_BATCH + 1))
    mean, std = rng.uniform(0.0, 1.0, b), rng.uniform(0.001, 0.3, b)
    ctx = rng.integers(1, 3000, b)
    cap = np.where(rng.uniform(size=b) < 0.8, rng.integers(0, 9, b), 0)
    powers = None
    if trial % 3 == 1:  # another acceptance model's survival (staged_acceptance), decreasing in j
        powers = np.cumprod(rng.uniform(0.3, 1.0, (b, 8)), axis=1)
    optimism = 0.5 if trial % 5 == 2 else 0.0
    args = (costs, SCORERS, "draft", mean, std, ctx, cap, 2, 0.02, optimism)
    return BatchProblem(*args, powers=powers), SmallProblem(*args, powers=powers), cap


def as_list(k) -> list[int]:
    return [int(x) for x in k]


@pytest.mark.parametrize("seed", range(4))
def test_the_small_batch_search_equals_the_numpy_search(seed):
    rng = np.random.default_rng(seed)
    for trial in range(60):
        batch, small, cap = problems(rng, trial)
        b = len(cap)
        assert [as_list(k) for k in batch.best_k] == small.best_k
        assert batch.best_goodput == small.best_goodput  # bit for bit
        assert batch.goodput_k0 == small.goodput_k0
        assert batch.top == small.top
        for s in range(len(SCORERS)):
            k, g = small.best_k[s], small.best_goodput[s]
            kb = np.array(k)
            for _ in range(3):  # any plan within the caps
                plan = [int(rng.integers(0, c + 1)) for c in cap]
                assert small.goodput(plan, s) == batch.goodput(np.array(plan), s)
                assert small.components(plan, s) == batch.components(np.array(plan), s)
                assert small.token_budget(plan, s) == batch.token_budget(np.array(plan), s)
                assert small.can_probe(plan) == batch.can_probe(np.array(plan))
                # a report, not a decision: numpy's SIMD power may differ by an ulp (module docstring)
                assert small.expected_at_mean(plan) == pytest.approx(
                    batch.expected_at_mean(np.array(plan)), rel=1e-14
                )
            last = [int(x) for x in rng.integers(0, 9, b)]
            held_b, held_s = batch.hold(kb, g, np.array(last), s, 0.02), small.hold(k, g, last, s, 0.02)
            assert (as_list(held_b[0]), held_b[1], held_b[2]) == held_s
            assert as_list(batch.probe(1.0, s)) == small.probe(1.0, s)
            for direction in (1, -1):
                d_b, d_s = batch.dither(kb, g, direction, s, 0.03), small.dither(k, g, direction, s, 0.03)
                assert d_b[1] == d_s[1] and (d_b[0] is None) == (d_s[0] is None)
                assert d_b[0] is None or as_list(d_b[0]) == d_s[0]
            for free in (0, 1, 3, 10_000):
                kv_b, kv_s = batch.fit_kv(kb, free, 16), small.fit_kv(k, free, 16)
                assert (as_list(kv_b[0]), kv_b[1]) == kv_s
            for max_k in (4, 8, 12):  # the search's own powers (8 >= max_k) and fresh ones (12)
                assert batch.intent(kb, g, s, max_k) == small.intent(k, g, s, max_k)


def test_a_dinkelbach_step_equals_numpy_s():
    """SmallProblem._improve against goodput_search.improve at λ around the best goodput (where the
    keep test of a request's drafts flips), plans and expected tokens bit for bit."""
    rng = np.random.default_rng(5)
    num_kept = num_dropped = 0
    for trial in range(80):
        batch, small, cap = problems(rng, trial)
        plans = uniform_plans(cap)
        lam = np.array(batch.best_goodput) * rng.uniform(0.3, 1.7, len(SCORERS))
        fixed = batch.table.spec_request_ms * np.arange(plans.shape[0])[:, None]
        k_np, e_np = improve(batch.table, batch.powers, batch.eval, plans, lam, fixed)
        k_py, e_py = small._improve(
            small.powers, small.ecum, plans.tolist(), lam.tolist(), fixed[:, 0].tolist()
        )
        assert k_np.tolist() == k_py
        assert e_np.sum(-1).tolist() == e_py
        num_kept += int((k_np > 0).sum())
        num_dropped += int(((k_np == 0) & (plans[None] > 0)).sum())
    assert num_kept > 100 and num_dropped > 100  # both sides of the keep test were exercised


def view(rng: np.random.Generator, b: int, step: int) -> BatchView:
    reqs = [
        RequestView(f"r{i}", int(rng.integers(50, 2000)), "ngram", int(c), float(a), float(sd), int(last))
        for i, (c, a, sd, last) in enumerate(
            zip(rng.integers(0, 9, b), rng.uniform(0, 1, b), rng.uniform(0.01, 0.3, b), rng.integers(0, 9, b))
        )
    ]
    return BatchView(reqs, int(rng.integers(0, 64)), 16, list(SCORERS), step)


def test_the_policy_decides_alike_on_either_path():
    """Two goodput policies, one searching small batches in plain Python and one with numpy only,
    fed the same views: the same plans and the same numbers in their infos, step after step (their
    hysteresis, probes, dither and tries feed back)."""
    rng = np.random.default_rng(11)
    costs = random_costs(rng)
    plain, numpy_only = GoodputPolicy(), GoodputPolicy(GoodputConfig(plain_search_max_batch=1))
    num_small = 0
    for step in range(80):
        v = view(rng, int(rng.integers(1, MAX_EXACT_BATCH + 3)), step)
        num_small += 2 <= len(v.requests) <= MAX_EXACT_BATCH
        a, b = plain.decide(v, costs), numpy_only.decide(v, costs)
        assert (a.k, a.scorer, a.predicted_ms) == (b.k, b.scorer, b.predicted_ms)
        assert a.info == b.info
    assert num_small > 40


def test_plain_search_max_batch_is_checked():
    with pytest.raises(ValueError, match="plain_search_max_batch must be in"):
        GoodputConfig(plain_search_max_batch=MAX_EXACT_BATCH + 1)
    with pytest.raises(ValueError, match="plain_search_max_batch must be in"):
        GoodputConfig(plain_search_max_batch=0)


def fed_estimator(rng: np.random.Generator, ids: list[str]) -> AcceptanceEstimator:
    """An estimator with both stages, fed span-like steps (none of 8 accepted, or most of them)."""
    est = AcceptanceEstimator()
    stages_of(est)
    for rid in ids:
        for _ in range(int(rng.integers(0, 30))):  # some requests never observed: the prior's rows
            k = int(rng.integers(1, 9))
            est.observe(rid, "ngram", k, int(rng.choice([0, k, max(k - 1, 0)])))
    return est


def test_staged_rows_are_staged_powers_bit_for_bit():
    rng = np.random.default_rng(2)
    ids = [f"r{i}" for i in range(40)]
    est = fed_estimator(rng, ids)
    for num in (1, 3, 8):
        m1, _, m2, s2 = est.stages.mean_std_many(ids, "ngram")
        assert staged_rows(est.stages, ids, "ngram", num) == staged_powers(m1, m2, s2, num).tolist()


def test_the_policy_with_two_acceptance_rates_decides_alike_on_either_path():
    rng = np.random.default_rng(12)
    costs = random_costs(rng)
    cfg = {"staged_acceptance": True}
    plain, numpy_only = (
        GoodputPolicy(GoodputConfig(**cfg)),
        GoodputPolicy(GoodputConfig(plain_search_max_batch=1, **cfg)),
    )
    for step in range(40):
        b = int(rng.integers(2, MAX_EXACT_BATCH + 1))
        v = view(rng, b, step)
        v = replace(v, acceptance=fed_estimator(rng, [r.request_id for r in v.requests]))
        a, b_ = plain.decide(v, costs), numpy_only.decide(v, costs)
        assert (a.k, a.scorer, a.info) == (b_.k, b_.scorer, b_.info)
