"""The engine's per-step host shortcuts change nothing: a fixed-policy run with the n-gram proposer's
work during scoring (``on_scoring``, the CUDA path, forced here) and preemptions gives the same outputs
and the same step records as the plain host path."""

from __future__ import annotations

import random

import pytest
import torch

from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.records import StepRecord
from specsched.engine.request import Request, SamplingParams, SpecParams


def make_engine(num_blocks: int) -> Engine:
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        # no time cap on a lone request's runs (spec.max_k 0 ones run alone at the end): two engines'
        # records are compared step by step, and the cap's length follows each one's measured ms
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, plain_decode_ms=None),
        spec=SpecConfig(proposer="ngram", scorers=["batch_expansion", "mqa"], max_k=4),
        policy={"name": "fixed", "k": 3, "scorer": "mqa"},
    )
    return Engine(cfg)


def run_records(engine: Engine, seed: int) -> tuple[list[list[int]], list[StepRecord]]:
    rng = random.Random(seed)
    records: list[StepRecord] = []
    engine.on_step = records.append
    reqs = []
    for i in range(8):
        motif = [rng.randrange(3, 40) for _ in range(rng.randint(2, 6))]
        sampling = SamplingParams(
            max_tokens=rng.randint(8, 40), ignore_eos=i % 2 == 0, stop_token_ids=[7] if i % 3 == 0 else []
        )
        spec = SpecParams(max_k=rng.choice([None, 0, 2]))
        reqs.append(Request(f"r{i}", (motif * 20)[: rng.randint(6, 30)], sampling, spec))
        engine.add_request(reqs[-1])
    while any(not r.is_finished for r in reqs):
        engine.step()
    return [r.output_ids for r in reqs], records


def run(engine: Engine, seed: int) -> tuple[list[list[int]], list[tuple]]:
    outputs, records = run_records(engine, seed)
    rows = [
        (r.step, r.kind, r.batch_size, r.num_tokens, r.scorer, r.num_emitted, [vars(q) for q in r.requests])
        for r in records
    ]
    return outputs, rows


def test_on_scoring_and_preemption_keep_outputs_and_records():
    for seed, num_blocks in [(0, 256), (1, 24)]:  # 24 blocks of 4 slots: requests get preempted
        plain, ahead = make_engine(num_blocks), make_engine(num_blocks)
        ahead.is_overlapped_observe = True  # as on CUDA: observe and on_scoring while scoring
        want, got = run(plain, seed), run(ahead, seed)
        assert got == want
        if num_blocks == 24:
            assert ahead.scheduler.num_preemptions > 0


def test_match_bits_table_equals_the_formula():
    from specsched.kernels.rejection_sampling import VerifyResult

    ks = [0, 1, 4, 4, 8, 32, 33, 40, 0]
    emitted = [[1], [1], [1, 2, 3], [1, 2, 3, 4, 5], [1] * 9, [1] * 20, [1] * 34, [1] * 3, [1, 2]]
    want = [("1" * (len(e) - 1) + ("0" if len(e) <= k else "")) if k else "" for e, k in zip(emitted, ks)]
    assert VerifyResult(emitted, ks).match_bits() == want


def reference_carry(ids, plan, view, max_joined, caps=None):
    """carry_plan before its same-batch pass (commit 31df89f), the k and counts it gave."""
    index = {rid: i for i, rid in enumerate(ids)}
    old_k, caps = plan.k, caps or {}
    kept = [(v, old_k[index[v.request_id]]) for v in view.requests if v.request_id in index]
    if not kept:
        return None
    num_joined = len(view.requests) - len(kept)
    if max_joined is not None and num_joined > max(1, int(max_joined * len(view.requests))):
        return None
    able = [(u, uk) for u, uk in kept if caps.get(u.request_id, 1) > 0]
    k, num_reopened = [], 0
    for v in view.requests:
        i = index.get(v.request_id)
        is_reopened = i is not None and old_k[i] == 0 and caps.get(v.request_id, 1) == 0 and v.max_k > 0
        if i is None or is_reopened:
            num_reopened += is_reopened
            like = [(abs(u.acceptance - v.acceptance), uk) for u, uk in able if u.proposer == v.proposer]
            k.append(min(min(like)[1], v.max_k) if like else 0)
        else:
            k.append(min(old_k[i], v.max_k))
    return k, num_joined, len(ids) - len(kept), num_reopened


def test_carry_plan_equals_the_reference():
    from specsched.engine.carry import carry_plan
    from specsched.policies.base import BatchView, Plan, RequestView

    rng = random.Random(7)
    for trial in range(400):
        ids = [f"r{i}" for i in range(rng.randint(1, 12))]
        plan = Plan([rng.choice([0, 0, 1, 3, 5]) for _ in ids], "mqa", "goodput", info={"k0_scorer": "be"})
        caps = {rid: rng.choice([0, 0, 2, 6]) for rid in ids} if trial % 3 else None
        batch = (
            list(ids) if trial % 2 else [r for r in ids if rng.random() < 0.8] + ["new1", "new2"][: trial % 3]
        )
        views = [
            RequestView(r, 20, rng.choice(["ngram", "draft"]), rng.choice([0, 1, 4, 9]), rng.random(), 0.1)
            for r in batch
        ]
        view = BatchView(views, 100, 16, ["mqa", "be"])
        for max_joined in (None, 0.125):
            got, want = (
                carry_plan(ids, plan, view, max_joined, caps),
                reference_carry(ids, plan, view, max_joined, caps),
            )
            if want is None:
                assert got is None
                continue
            k, joined, left, reopened = want
            assert got.k == k and got.scorer == ("be" if not any(k) else "mqa")
            assert (got.info["num_joined"], got.info["num_left"], got.info["num_reopened"]) == (
                joined,
                left,
                reopened,
            )


def test_request_views_caps_and_estimates():
    """request_views, one proposer (mean_std_many) and mixed (mean_std each): the cap is the min of the
    peek, spec.max_k, the tokens left and the context left, the estimate is mean_std's."""
    from specsched.engine.proposing import request_views
    from specsched.policies.acceptance import AcceptanceEstimator

    rng = random.Random(11)
    est = AcceptanceEstimator()
    reqs = []
    for i in range(12):
        sampling = SamplingParams(max_tokens=rng.randint(1, 30))
        r = Request(
            f"v{i}", [3] * rng.randint(1, 40), sampling, SpecParams(max_k=rng.choice([None, 0, 2, 9]))
        )
        r.output_ids = [4] * rng.randint(0, sampling.max_tokens - 1)
        reqs.append(r)
        if i % 2:
            est.observe(r.request_id, "ngram", 4, rng.randint(0, 4))
    for names in (["ngram"] * 12, [rng.choice(["ngram", "draft"]) for _ in range(12)]):
        peek = [rng.choice([0, 3, 1 << 30]) for _ in reqs]
        views = request_views(reqs, names, peek, est, 8, 64)
        for r, n, m, v in zip(reqs, names, peek, views):
            cap = min(m, 8, r.sampling.max_tokens - len(r.output_ids) - 1, 64 - r.num_tokens)
            cap = cap if r.spec.max_k is None else min(cap, r.spec.max_k)
            assert (v.max_k, v.context_len, v.proposer) == (max(cap, 0), r.num_tokens, n)
            assert (v.acceptance, v.acceptance_std) == est.mean_std(r.request_id, n)


def test_kept_stops_at_eos_stop_ids_and_limits():
    """The commit's stopping rule (``Engine._kept``, whose common case returns every token at once):
    the prefix through the first EOS or stop id (STOP) or the token that reaches max_tokens or the
    context (LENGTH)."""
    from specsched.engine.request import FinishReason

    engine = make_engine(256)
    eos = next(iter(engine.eos_token_ids))
    other = next(t for t in range(1, 100) if t not in engine.eos_token_ids and t != 7)

    def kept(tokens: list[int], num_out: int = 0, **sampling) -> tuple[list[int], FinishReason | None]:
        sp = SamplingParams(**{"max_tokens": 50, **sampling})
        r = Request("r", [other] * 10, sp, output_ids=[other] * num_out)
        return engine._kept(r, tokens)

    toks = [other, other, other]
    assert kept(toks) == (toks, None)
    assert kept([other, eos, other]) == ([other, eos], FinishReason.STOP)
    assert kept([other, eos, other], ignore_eos=True) == ([other, eos, other], None)
    assert kept([other, 7, other], stop_token_ids=[7]) == ([other, 7], FinishReason.STOP)
    assert kept(toks, stop_token_ids=[7]) == (toks, None)
    assert kept(toks, num_out=47) == (toks, FinishReason.LENGTH)  # the 3rd token is the 50th
    assert kept(toks, num_out=46) == (toks, None)
    assert kept(toks, num_out=48) == (toks[:2], FinishReason.LENGTH)
    room = engine.max_model_len - 10  # output tokens that fit the context beside the prompt
    assert kept(toks, num_out=room - 2, max_tokens=10**6) == (toks[:2], FinishReason.LENGTH)


def test_prefill_step_indexes_the_prompt_for_the_first_decode_peek():
    """The engine hands each prefill's requests to their proposer (``on_prefill``) before the step's
    read, so a request's first decode peek finds its prompt's n-grams indexed (it indexes at most the
    token its prefill emitted, not the prompt on the decode step's critical path); outputs unchanged."""
    engine = make_engine(256)
    prop = engine.proposers["ngram"]
    first_peek: dict[str, tuple[int, int]] = {}  # request id -> (positions indexed before it, tokens)
    inner = prop.peek

    def peek(batch):
        for r in batch:
            c = prop._cache.get(r.request_id)
            first_peek.setdefault(r.request_id, (c.index.num_indexed if c else 0, r.num_tokens))
        return inner(batch)

    prop.peek = peek
    got = run(engine, 0)
    assert got == run(make_engine(256), 0)
    assert len(first_peek) == 8
    for rid, (indexed, num_tokens) in first_peek.items():
        assert indexed >= num_tokens - 2, (rid, indexed, num_tokens)


def test_deferred_prediction_logs_what_the_decide_would_have_predicted():
    """A static policy decides without the cost models (``is_prediction_deferred``: its decide gets
    ``costs=None``) and the engine fills the prediction after the scoring launch: every decode
    record's predicted ms and plan info equal what ``predict_plan`` gave on the engine's costs at the
    decide (the cost models learn from measured times, so this is checked within one run), with the
    overlapped observe on (as on CUDA) and off, preemptions included."""
    import copy

    from specsched.policies.fixed import FixedConfig, FixedPolicy, predict_plan

    class Deferred(FixedPolicy):
        def __init__(self, engine: Engine) -> None:
            super().__init__(FixedConfig(k=3, scorer="mqa"))
            self.engine, self.at_decide = engine, []

        def decide(self, view, costs):
            assert costs is None
            plan = super().decide(view, costs)
            assert plan.predicted_ms is None
            want = predict_plan(copy.deepcopy(plan), view, self.engine.costs)
            self.at_decide.append((want.predicted_ms, want.info))
            return plan

    for overlapped in (False, True):
        engine = make_engine(24)
        engine.policy = Deferred(engine)
        engine.is_overlapped_observe = overlapped
        _, records = run_records(engine, 1)
        got = [
            (
                r.predicted_ms,
                {
                    k: v
                    for k, v in r.plan_info.items()
                    if k not in ("decide_ms", "decide_cpu_ms", "is_after_run", "decode_steps")
                },
            )
            for r in records
            if r.kind == "decode"
        ]
        assert got == engine.policy.at_decide and len(got) > 10
        assert all(ms is not None and ms > 0 for ms, _ in got)
        assert all(
            r.predicted_score_ms == r.plan_info["predicted_score_ms"] for r in records if r.kind == "decode"
        )


def test_a_plan_that_drafts_nothing_calls_no_proposer():
    """A run of plain steps (every k = 0) asks no proposer for drafts: zero drafts for every request."""
    from specsched.engine.proposing import propose
    from specsched.proposers.base import Proposer

    class Refuses(Proposer):
        name = "refuses"

        def propose(self, batch, k):
            raise AssertionError(f"propose called with k={k}")

    reqs = [Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=4)) for i in range(3)]
    props = propose({"refuses": Refuses()}, reqs, [0, 0, 0], ["refuses"] * 3, 256, torch.device("cpu"))
    assert props.num_draft == [0, 0, 0] and props.cu_num_draft.tolist() == [0, 0, 0, 0]
    with pytest.raises(AssertionError, match=r"k=\[0, 1, 0\]"):
        propose({"refuses": Refuses()}, reqs, [0, 1, 0], ["refuses"] * 3, 256, torch.device("cpu"))
