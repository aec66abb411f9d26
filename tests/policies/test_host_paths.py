"""The per-step host paths of the fixed policies and the engine's view against their references:
``shape_stats`` against ``StepShape``, the scalar ``predict_stats`` against the array one, the inlined
expected tokens, ``mean_std_many`` against ``mean_std``, the bisection of ``pad_to_bucket``."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from specsched.policies.acceptance import AcceptanceEstimator
from specsched.policies.base import RequestView
from specsched.policies.cost_model import CostModels
from specsched.policies.fixed import _expected_sum, _expected_tokens
from specsched.policies.shapes import ShapeStats, StepShape, pad_to_bucket, shape_stats


def test_shape_stats_equals_the_step_shape():
    rng = np.random.default_rng(0)
    for b in [0, 1, 2, 7, 64]:
        for _ in range(20):
            k, ctx = rng.integers(0, 9, b).tolist(), rng.integers(0, 3000, b).tolist()
            assert shape_stats(k, ctx) == StepShape(k, ctx).stats()
    with pytest.raises(ValueError, match="one k per context"):
        shape_stats([1, 2], [3])
    with pytest.raises(ValueError, match=">= 0"):
        shape_stats([1, -1], [3, 4])
    with pytest.raises(ValueError, match=">= 0"):
        shape_stats([1, 1], [3, -4])


def test_scalar_predict_equals_the_array_predict():
    """One shape's prediction (no numpy) is the array path's, bit for bit, with learnt models."""
    rng = np.random.default_rng(1)
    costs = CostModels({"mqa_graph": [1, 2, 4, 8, 16, 32, 64, 128]}, device="cpu")
    for scorer in ("mqa_graph", "batch_expansion", "mqa"):
        for _ in range(40):  # learn some coefficients, then predict
            b = int(rng.integers(1, 80))
            k, ctx = rng.integers(0, 6, b).tolist(), rng.integers(1, 2000, b).tolist()
            s = shape_stats(k, ctx)
            one = costs.predict_stats(scorer, "ngram", s)
            arrays = ShapeStats(*(np.array([v]) for v in vars(s).values()))
            many = costs.predict_stats(scorer, "ngram", arrays)
            got = [one.propose_ms, one.score_ms, one.verify_ms, one.overhead_ms]
            assert all(type(v) is float for v in got)
            want = (many.propose_ms, many.score_ms, many.verify_ms, many.overhead_ms)
            assert got == [float(v[0]) for v in want]
            assert one == costs.predict(scorer, "ngram", StepShape(k, ctx))
            m = costs.model("score", scorer)
            m.update(costs.score_features(scorer, s), float(rng.uniform(0.1, 5.0)))
            costs.model("propose", "ngram").update([1.0, s.max_k, s.max_k * 3, s.num_draft_tokens], 0.3)


def test_pad_to_bucket_bisects_as_searchsorted():
    buckets = np.array([1, 2, 4, 8, 16, 24, 32, 48, 64])
    for n in range(0, 80):
        idx = int(np.searchsorted(buckets, n, side="left"))
        want = (n, True) if idx >= len(buckets) else (int(buckets[idx]), False)
        assert pad_to_bucket(n, buckets) == want
        assert type(pad_to_bucket(n, buckets)[0]) is int


@pytest.mark.parametrize("a", [0.0, 0.3, 0.999999999999, 1.0 - 1e-10, 1.0, 1.5, -0.2])
def test_expected_sum_equals_the_per_request_sum(a):
    views = [RequestView(f"r{i}", 10, "ngram", 8, a, 0.1) for i in range(6)]
    ks = [0, 1, 2, 5, 8, 0]
    assert _expected_sum(views, ks) == sum(map(_expected_tokens, views, ks))
    with pytest.raises(ValueError, match="acceptance rate"):
        _expected_sum([RequestView("x", 10, "ngram", 8, math.nan, 0.1)], [2])


def test_mean_std_many_equals_mean_std():
    rng = random.Random(3)
    est = AcceptanceEstimator()
    ids = [f"r{i}" for i in range(40)]
    for step in range(60):
        for rid in rng.sample(ids, 20):
            k = rng.randint(1, 5)
            est.observe(rid, "ngram", k, rng.randint(0, k))
        if step % 7 == 0:
            est.forget(rng.choice(ids))
        want = [est.mean_std(rid, "ngram") for rid in ids + ["fresh"]]
        assert est.mean_std_many(ids + ["fresh"], "ngram") == want
    assert est.mean_std_many([], "draft") == []
