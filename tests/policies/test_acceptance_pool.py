"""Shared acceptance priors (issue 13): a young request borrows its proposer's pooled posterior, with
a prior strength estimated from how much the pool's requests differ (empirical Bayes)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specsched.policies.acceptance import AcceptanceConfig, AcceptanceEstimator


def walk(rng: random.Random, a: float, k: int) -> int:
    n = 0
    while n < k and rng.random() < a:
        n += 1
    return n


def pool(est: AcceptanceEstimator, rates: list[float], steps: int = 30, seed: int = 0, k: int = 4) -> None:
    """One finished request per rate, ``steps`` steps of ``k`` drafts each."""
    rng = random.Random(seed)
    for i, a in enumerate(rates):
        for _ in range(steps):
            est.observe(f"old{i}", "draft", k, walk(rng, a, k))
        est.forget(f"old{i}")


def test_new_request_starts_at_the_pool_and_stays_near_it_with_few_observations():
    est = AcceptanceEstimator()
    pool(est, [0.9] * 8)
    mean, std = est.mean_std("new", "draft")
    assert mean == pytest.approx(0.9, abs=0.03)  # not the static prior's 0.5
    assert std < 0.05  # a homogeneous pool lends many pseudo-observations
    est.observe("new", "draft", 4, 0)  # two unlucky steps
    est.observe("new", "draft", 4, 0)
    assert est.mean("new", "draft") > 0.85


def test_own_evidence_dominates_as_it_grows():
    est = AcceptanceEstimator()
    pool(est, [0.9] * 8)
    rng = random.Random(1)
    for _ in range(300):
        est.observe("new", "draft", 4, walk(rng, 0.5, 4))
    assert est.mean("new", "draft") == pytest.approx(0.5, abs=0.06)


def test_a_heterogeneous_pool_lends_little():
    est = AcceptanceEstimator()
    pool(est, [0.2, 0.9] * 4)
    assert est.prior_strength("draft") < 4.0  # requests differ: the pool says little about a new one
    start = est.mean("new", "draft")  # the pool's mean, ~0.73 (the 0.9 requests drafted more)
    est.observe("new", "draft", 4, 0)
    est.observe("new", "draft", 4, 0)
    assert est.mean("new", "draft") < start - 0.2  # the new request's own two rejections weigh


def test_prior_strength_estimates_the_spread_of_the_pool():
    """Requests' rates drawn from Beta(12, 8) (strength 20), 100 steps each: the method-of-moments
    strength recovers it."""
    rng = np.random.default_rng(3)
    est = AcceptanceEstimator(AcceptanceConfig(pool_requests=200, max_prior_strength=500.0))
    pool(est, rng.beta(12.0, 8.0, 200).tolist(), steps=100, seed=4)
    assert est.prior_strength("draft") == pytest.approx(20.0, rel=0.35)


def test_a_young_pool_lends_the_default_strength():
    est = AcceptanceEstimator()
    pool(est, [0.9, 0.9])  # two requests: too few to tell how they spread
    assert est.prior_strength("draft") == est.config.prior_strength
    with pytest.raises(ValueError, match="max_prior_strength"):
        AcceptanceConfig(prior_strength=10.0, max_prior_strength=5.0)
