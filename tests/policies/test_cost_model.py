from __future__ import annotations

import sqlite3

import numpy as np
import pytest
import sqlite_utils

from specsched.engine.records import StepRecord, StepRequestRecord
from specsched.policies.cost_model import CostModels
from specsched.policies.rls import OnlineLinearModel
from specsched.policies.shapes import StepShape


def record(scorer: str, proposer: str, k: list[int], ctx: list[int], **times) -> StepRecord:
    """A decode step record; ``ctx`` as the policy sees it (KV-cached tokens + the input token)."""
    reqs = [StepRequestRecord(f"r{i}", c - 1, ki, 0) for i, (ki, c) in enumerate(zip(k, ctx, strict=True))]
    return StepRecord(
        0, "decode", 0.0, len(k), sum(k) + len(k), scorer=scorer, proposer=proposer, requests=reqs, **times
    )


def random_shape(rng: np.random.Generator, max_batch: int = 16, max_k: int = 6) -> StepShape:
    b = int(rng.integers(1, max_batch + 1))
    return StepShape(rng.integers(0, max_k + 1, b).tolist(), rng.integers(20, 3000, b).tolist())


def test_step_shape_properties_and_validation():
    s = StepShape([2, 0, 3], [10, 20, 30])
    assert (s.batch_size, s.num_tokens, s.max_k, s.num_context_tokens, s.num_draft_tokens) == (3, 8, 3, 60, 5)
    stats = s.stats()
    assert stats.num_spec_requests == 2
    assert stats.num_weighted_context_tokens == 3 * 10 + 1 * 20 + 4 * 30
    with pytest.raises(ValueError, match="one k per context"):
        StepShape([1], [1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        StepShape([-1], [5])


def test_rls_recovers_known_coefficients_with_noise():
    rng = np.random.default_rng(0)
    true = np.array([2.0, 0.5, 0.01, 3.0])
    m = OnlineLinearModel(4, forgetting=0.995)
    for _ in range(3000):
        x = np.array([1.0, rng.uniform(0, 20), rng.uniform(0, 500), rng.uniform(0, 2)])
        m.update(x, float(true @ x + rng.normal(0, 0.2)))
    assert np.allclose(m.coef, true, rtol=0.05, atol=0.05)
    assert m.num_updates == 3000


def test_rls_follows_a_step_change_only_with_forgetting():
    rng = np.random.default_rng(1)
    before, after = np.array([1.0, 0.2]), np.array([4.0, 0.6])
    forgetful, rigid = OnlineLinearModel(2, forgetting=0.97), OnlineLinearModel(2, forgetting=1.0)
    xs = [np.array([1.0, rng.uniform(0, 30)]) for _ in range(1200)]
    for i, x in enumerate(xs):
        y = float((before if i < 600 else after) @ x + rng.normal(0, 0.1))
        forgetful.update(x, y)
        rigid.update(x, y)
    assert np.allclose(forgetful.coef, after, rtol=0.05)
    assert not np.allclose(rigid.coef, after, rtol=0.2)  # plain least squares averages both regimes


def test_rls_prediction_never_negative_and_no_windup():
    m = OnlineLinearModel(3, forgetting=0.95, prior_var=100.0, coef=[-5.0, 0.0, 0.0])
    assert m.predict([1.0, 0.0, 0.0]) == 0.0
    assert np.all(m.predict([np.ones(4), np.zeros(4), np.zeros(4)]) == 0.0)
    for _ in range(5000):  # third feature never excited
        m.update([1.0, 2.0, 0.0], 3.0)
    assert np.all(np.isfinite(m.cov)) and np.all(np.diag(m.cov) <= 100.0 + 1e-9)
    assert m.predict([1.0, 2.0, 0.0]) == pytest.approx(3.0, rel=1e-3)


def test_rls_validation_and_state_roundtrip():
    with pytest.raises(ValueError, match="forgetting"):
        OnlineLinearModel(2, forgetting=1.5)
    m = OnlineLinearModel(2, coef=[1.0, 2.0])
    with pytest.raises(ValueError, match="features"):
        m.update([1.0], 1.0)
    with pytest.raises(ValueError, match="non-finite"):
        m.update([1.0, float("nan")], 1.0)
    m.update([1.0, 3.0], 9.0)
    other = OnlineLinearModel(2)
    other.load_state_dict(m.state_dict())
    assert other.predict([1.0, 5.0]) == m.predict([1.0, 5.0])
    with pytest.raises(ValueError, match="shapes"):
        other.load_state_dict({"coef": [1.0], "cov": [[1.0]]})


def true_times(scorer: str, shape: StepShape) -> dict[str, float]:
    """A synthetic machine: MQA reads each prefix once, batch expansion once per row."""
    rows_ctx = sum((k + 1) * c for k, c in zip(shape.k, shape.context_lens, strict=True)) / 1e3
    if scorer == "mqa":
        score = 3.0 + 0.05 * shape.num_tokens + 0.2 * shape.num_context_tokens / 1e3
    else:
        score = 1.0 + 0.08 * shape.num_tokens + 0.2 * rows_ctx
    propose = 0.3 + 0.7 * shape.max_k + 0.01 * shape.max_k * shape.batch_size if shape.max_k else 0.0
    verify = 0.1 + 0.002 * shape.num_tokens
    return {
        "propose_ms": propose,
        "score_ms": score,
        "verify_ms": verify,
        "total_ms": propose + score + verify + 0.5 + 0.03 * shape.batch_size,
    }


def test_cost_models_learn_a_synthetic_machine_through_profile():
    rng = np.random.default_rng(2)
    costs = CostModels()
    noise = lambda: float(rng.normal(0, 0.02))

    def timed(shape: StepShape) -> list[StepRecord]:
        out = []
        for scorer in ("mqa", "batch_expansion"):
            t = true_times(scorer, shape)
            t = {n: v + noise() if v else v for n, v in t.items()}
            out.append(record(scorer, "draft", shape.k, shape.context_lens, **t))
        return out

    used = costs.profile(timed, [random_shape(rng) for _ in range(600)])
    assert used == 1200
    for _ in range(30):  # held-out shapes
        shape = random_shape(rng)
        for scorer in ("mqa", "batch_expansion"):
            truth = true_times(scorer, shape)
            pred = costs.predict(scorer, "draft", shape)
            assert pred.score_ms == pytest.approx(truth["score_ms"], rel=0.05, abs=0.1)
            assert pred.propose_ms == pytest.approx(truth["propose_ms"], rel=0.05, abs=0.1)
            assert pred.total_ms == pytest.approx(truth["total_ms"], rel=0.05, abs=0.2)


def test_propose_cost_is_zero_without_drafts_and_grows_with_max_k():
    costs = CostModels()
    assert costs.predict("mqa", "draft", StepShape([0, 0], [100, 100])).propose_ms == 0.0
    p2 = costs.predict("mqa", "draft", StepShape([2, 0], [100, 100])).propose_ms
    p6 = costs.predict("mqa", "draft", StepShape([6, 0], [100, 100])).propose_ms
    assert 0.0 < p2 < p6


def test_graph_buckets_pad_and_eager_above_the_largest():
    costs = CostModels({"batch_expansion": [1, 2, 4, 8]}, device="cuda")
    score = lambda k: costs.predict("batch_expansion", "ngram", StepShape([k], [1])).score_ms
    # rows = k + 1: 4 -> 5 rows crosses bucket 4 -> 8; 5 -> 6 rows stays in bucket 8
    assert score(4) - score(3) > 5 * abs(score(5) - score(4))
    assert score(8) > score(7) + 5.0  # 9 rows: no graph, eager penalty
    assert costs.predict("mqa", "ngram", StepShape([4], [1])).score_ms > 0  # eager scorer: no buckets


def test_observe_skips_prefill_and_rejects_bad_records():
    costs = CostModels()
    pre = StepRecord(0, "prefill", 0.0, 1, 100, score_ms=50.0, total_ms=51.0)
    assert costs.observe(pre) is False
    with pytest.raises(ValueError, match="no scorer"):
        costs.observe(record(None, "draft", [1], [10], score_ms=1.0))
    with pytest.raises(ValueError, match="invalid timings"):
        costs.observe(record("mqa", "draft", [1], [10], score_ms=float("nan")))
    assert costs.observe(record("mqa", "draft", [0], [10], score_ms=2.0, total_ms=3.0))
    assert ("propose", "draft") not in costs.models  # no drafts, the draft model is not touched


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="device"):
        CostModels(device="tpu")
    with pytest.raises(ValueError, match="graph_buckets"):
        CostModels({"batch_expansion": []})
    with pytest.raises(ValueError, match="bad cost-model key"):
        CostModels().model("score")


def test_save_load_roundtrip(tmp_path):
    rng = np.random.default_rng(3)
    costs = CostModels({"batch_expansion": [1, 2, 4, 8, 16, 32, 64]})
    for _ in range(50):
        shape = random_shape(rng)
        costs.observe(
            record(
                "batch_expansion",
                "ngram",
                shape.k,
                shape.context_lens,
                **true_times("batch_expansion", shape),
            )
        )
    path = tmp_path / "run.sqlite"
    costs.save(sqlite_utils.Database(path), run_id=7)
    fresh = CostModels()
    fresh.save(str(path), run_id=3)
    loaded = CostModels.load(sqlite_utils.Database(path))  # latest run_id = 7
    assert loaded.graph_buckets["batch_expansion"].tolist() == [1, 2, 4, 8, 16, 32, 64]
    for _ in range(10):
        shape = random_shape(rng)
        assert loaded.predict("batch_expansion", "ngram", shape) == costs.predict(
            "batch_expansion", "ngram", shape
        )
    assert loaded.model("score", "batch_expansion").num_updates == 50
    early = CostModels.load(path, run_id=3)
    assert early.model("score", "batch_expansion").num_updates == 0
    costs.save(sqlite_utils.Database(path), run_id=7)  # saving again replaces, not duplicates
    # one row per model, and one for the scorer's per-graph residuals (policies/bucket_bias.py)
    assert sqlite_utils.Database(path)["cost_models"].count_where("run_id = 7") == len(costs.models) + 1
    assert loaded.biases["batch_expansion"].stats == costs.biases["batch_expansion"].stats


def test_load_errors_are_clear(tmp_path):
    path = tmp_path / "bad.sqlite"
    with pytest.raises(ValueError, match="no 'cost_models' table"):
        CostModels.load(sqlite_utils.Database(path))
    db = sqlite_utils.Database(path)
    db["cost_models"].insert({"run_id": 1, "component": "score"})
    with pytest.raises(ValueError, match="missing columns"):
        CostModels.load(db)
    CostModels().save(tmp_path / "ok.sqlite", run_id=1)
    with pytest.raises(ValueError, match="no cost models saved for run_id 5"):
        CostModels.load(tmp_path / "ok.sqlite", run_id=5)
    costs = CostModels()
    costs.model("verify")
    costs.save(tmp_path / "broken.sqlite", run_id=1)
    conn = sqlite3.connect(tmp_path / "broken.sqlite")
    conn.execute("update cost_models set coefficients = '[1.0, oops'")
    conn.commit()
    conn.close()
    with pytest.raises(ValueError, match="malformed 'cost_models' row"):
        CostModels.load(tmp_path / "broken.sqlite")


def test_overhead_learns_the_callers_time_between_steps():
    """``host_ms["between"]`` (the daemon streaming the last step's outputs) is part of what a step
    costs: the overhead model learns it, and the prequential error compares against it."""

    def rec(step: int, between: float | None) -> StepRecord:
        reqs = [StepRequestRecord(f"r{i}", 100, 2, 1, "10") for i in range(4)]
        host = {"between": between} if between is not None else {}
        return StepRecord(step, "decode", 0.0, 4, 12, "mqa", "fixed", "ngram", propose_ms=0.1,
                          score_ms=1.0, verify_ms=0.1, total_ms=1.5, num_emitted=8, requests=reqs,
                          host_ms=host)  # fmt: skip

    assert rec(0, 0.7).cost_ms == pytest.approx(2.2) and rec(0, None).cost_ms == 1.5
    assert rec(0, float("nan")).cost_ms == 1.5
    with_between, without = CostModels(device="cpu"), CostModels(device="cpu")
    for i in range(64):
        with_between.observe(rec(i, 0.7))
        without.observe(rec(i, None))
    shape = StepShape([2] * 4, [100] * 4)
    gap = with_between.predict("mqa", "ngram", shape).total_ms
    gap -= without.predict("mqa", "ngram", shape).total_ms
    assert gap == pytest.approx(0.7, abs=0.05)


def stall_costs_and_coefs(n: int = 80) -> tuple[CostModels, dict]:
    """Models that have learnt one shape's steady times (their error is small)."""
    costs = CostModels(device="cuda")
    for _ in range(n):
        rec = record(
            "mqa", "draft", [3, 3], [300, 400], propose_ms=0.4, score_ms=1.2, verify_ms=0.1, total_ms=2.0
        )
        assert costs.observe(rec)
    assert costs.errors["mqa"].value < 0.05
    return costs, {key: m.coef.copy() for key, m in costs.models.items()}


def test_a_stalled_step_teaches_no_model_but_moves_the_error():
    costs, coefs = stall_costs_and_coefs()
    before = costs.errors["mqa"].value
    stall = record(
        "mqa", "draft", [3, 3], [300, 400], propose_ms=0.4, score_ms=1.2, verify_ms=0.1, total_ms=60.0
    )
    assert costs.observe(stall) is False
    assert costs.num_stalls == 1
    assert all((costs.models[key].coef == c).all() for key, c in coefs.items())
    assert costs.errors["mqa"].value > before
    # a step 3x its prediction is not a stall: it teaches
    slow = record(
        "mqa", "draft", [3, 3], [300, 400], propose_ms=0.4, score_ms=1.2, verify_ms=0.1, total_ms=6.0
    )
    assert costs.observe(slow) is True
    assert not (costs.models[("overhead",)].coef == coefs[("overhead",)]).all()


def test_costs_that_really_moved_are_learnt_after_a_few_steps():
    costs, coefs = stall_costs_and_coefs()
    moved = [
        record("mqa", "draft", [3, 3], [300, 400], propose_ms=2.0, score_ms=6.0, verify_ms=0.5, total_ms=10.0)
        for _ in range(40)
    ]
    taken = [costs.observe(r) for r in moved]
    assert not taken[0]  # the first looks like a stall
    assert sum(taken[:8]) >= 1 and all(taken[-20:])  # then the error says the machine changed
    # the models follow (from 2.0 ms; forgetting 0.99 keeps part of the 80 old steps)
    assert costs.predict("mqa", "draft", StepShape([3, 3], [300, 400])).total_ms > 6.0
