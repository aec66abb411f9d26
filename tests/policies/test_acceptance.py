from __future__ import annotations

import random

import pytest

from specsched.policies.acceptance import AcceptanceConfig, AcceptanceEstimator, beta_std, expected_tokens


def simulate_step(rng: random.Random, a: float, k: int) -> int:
    """Accepted drafts of one step: each draft accepted with probability a until the first rejection."""
    n = 0
    while n < k and rng.random() < a:
        n += 1
    return n


def test_expected_tokens_closed_form_against_simulation():
    rng = random.Random(0)
    for a, k in [(0.3, 2), (0.6, 4), (0.9, 8)]:
        mean = sum(simulate_step(rng, a, k) + 1 for _ in range(40000)) / 40000
        assert expected_tokens(a, k) == pytest.approx(mean, rel=0.02)


def test_expected_tokens_limits():
    assert expected_tokens(0.7, 0) == pytest.approx(1.0)
    assert expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert expected_tokens(1.0, 5) == pytest.approx(6.0)
    assert expected_tokens(1.0 - 1e-12, 3) == pytest.approx(4.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25


@pytest.mark.parametrize("a,k", [(-0.1, 2), (1.5, 2), (float("nan"), 1), (0.5, -1)])
def test_expected_tokens_rejects_bad_input(a, k):
    with pytest.raises(ValueError):
        expected_tokens(a, k)


def test_posterior_converges_to_true_rate():
    rng = random.Random(1)
    est = AcceptanceEstimator()
    for _ in range(3000):
        est.observe("r", "draft", 4, simulate_step(rng, 0.7, 4))
    assert est.mean("r", "draft") == pytest.approx(0.7, abs=0.03)
    assert est.std("r", "draft") < 0.02


def test_truncated_observation_counts():
    est = AcceptanceEstimator(AcceptanceConfig(priors={"draft": (2.0, 2.0)}))
    est.observe("r", "draft", 3, 3)  # all accepted: 3 successes, no failure
    assert est.posterior("r", "draft") == pytest.approx((5.0, 2.0))
    est.observe("r", "draft", 3, 1)  # one accepted, then a rejection
    assert est.posterior("r", "draft") == pytest.approx((6.0, 3.0))
    est.observe("r", "draft", 0, 0)  # no drafts, no information
    assert est.posterior("r", "draft") == pytest.approx((6.0, 3.0))
    assert est.std("r", "draft") == pytest.approx(beta_std(6.0, 3.0))


def test_priors_per_proposer_and_aggregate_prior_for_new_requests():
    est = AcceptanceEstimator()
    assert est.mean("new", "ngram") == pytest.approx(1 / 3)
    assert est.mean("new", "draft") == pytest.approx(1 / 2)
    rng = random.Random(2)
    for i in range(200):
        est.observe(f"old{i % 5}", "ngram", 4, simulate_step(rng, 0.9, 4))
    prior_mean = est.mean("fresh", "ngram")
    assert 0.7 < prior_mean < 0.95  # moved towards the proposer's aggregate
    alpha, beta = est.prior("ngram")
    assert alpha + beta <= est.config.max_prior_strength + 1e-9  # but a weak prior
    assert est.mean("fresh", "draft") == pytest.approx(0.5)  # other proposers untouched


def test_aggregate_decay_follows_a_change():
    est = AcceptanceEstimator(AcceptanceConfig(aggregate_decay=0.98))
    rng = random.Random(3)
    for i in range(500):
        est.observe(f"a{i}", "draft", 4, simulate_step(rng, 0.9, 4))
    for i in range(500):
        est.observe(f"b{i}", "draft", 4, simulate_step(rng, 0.2, 4))
    assert est.aggregate_mean("draft") < 0.4


def test_forget_and_validation():
    est = AcceptanceEstimator()
    est.observe("r", "draft", 2, 2)
    assert est.num_requests == 1
    est.forget("r")
    est.forget("unknown")  # no error
    assert est.num_requests == 0
    with pytest.raises(ValueError, match="num_accepted"):
        est.observe("r", "draft", 2, 3)
    with pytest.raises(ValueError, match="k must be"):
        est.observe("r", "draft", -1, 0)
    with pytest.raises(ValueError, match="prior"):
        AcceptanceConfig(priors={"x": (0.0, 1.0)})
    with pytest.raises(ValueError, match="aggregate_decay"):
        AcceptanceConfig(aggregate_decay=1.5)


def test_concurrent_requests_share_what_they_see():
    """Partial pooling: a running request's prior follows the proposer's aggregate of the *other*
    requests' steps at every lookup, so side-by-side requests learn from each other at once."""
    est = AcceptanceEstimator()
    est.observe("a", "draft", 1, 0)  # "a" and "b" both started (prior Beta(2, 2))
    est.observe("b", "draft", 1, 0)
    before = est.mean("a", "draft")
    rng = random.Random(4)
    for _ in range(100):
        est.observe("b", "draft", 4, simulate_step(rng, 0.9, 4))
    assert est.mean("a", "draft") > before + 0.2  # "a" moved with "b"'s evidence
    alpha, beta = est.posterior("a", "draft")
    assert alpha + beta <= est.config.max_prior_strength + 1.0 + 1e-9  # capped prior + a's one failure
    # a request's own counts are not counted twice: alone, its posterior is the base prior + its counts
    solo = AcceptanceEstimator()
    for n in (3, 1, 2):
        solo.observe("r", "draft", 3, n)
    assert solo.posterior("r", "draft") == pytest.approx((2.0 + 6.0, 2.0 + 2.0))
