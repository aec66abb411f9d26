"""Engine: speculative greedy == non-speculative greedy, for both scorers and every proposer."""

from __future__ import annotations

import random

import pytest
import torch

from specsched.engine.config import (
    CacheConfig,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from specsched.engine.engine import Engine
from specsched.engine.request import Request, SamplingParams, SpecParams
from specsched.policies.base import BatchView, Plan, Policy


class RandomKPolicy(Policy):
    """Test policy: a random k in [0, max_k] per request every step (ragged, 0 included)."""

    name = "random_k"

    def __init__(self, scorer: str, seed: int = 0, max_k: int = 8) -> None:
        self.scorer, self.rng, self.max_k = scorer, random.Random(seed), max_k

    def decide(self, view: BatchView, costs) -> Plan:
        return Plan(
            [self.rng.randint(0, min(self.max_k, r.max_k)) for r in view.requests], self.scorer, self.name
        )


def make_engine(
    proposer: str = "none", scorer: str = "mqa", seed: int = 0, num_blocks: int = 512, **spec
) -> Engine:
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        spec=SpecConfig(proposer=proposer, scorers=["batch_expansion", "mqa"], max_k=8, **spec),
        policy={"name": "fixed", "k": 0, "scorer": "mqa"},
    )
    engine = Engine(cfg)
    engine.policy = RandomKPolicy(scorer, seed)
    return engine


def random_prompts(rng: random.Random, n: int) -> list[list[int]]:
    # lengths cross block boundaries (block_size 4); a repeated motif gives n-gram matches
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 256) for _ in range(rng.randint(2, 6))]
        p = (motif * 20)[: rng.randint(1, 70)]
        p[-1] = rng.randrange(3, 256) if rng.random() < 0.3 else p[-1]
        out.append(p)
    return out


@pytest.fixture(scope="module")
def baseline() -> Engine:
    return make_engine("none")


PROPOSERS = [
    ("ngram", {}),
    ("draft", {"draft": DraftConfig(source="self", num_layers=2)}),  # the target's KV cache shared
    ("draft", {"draft": DraftConfig(source="self", num_layers=2, shared_kv=False)}),
    ("draft", {"draft": DraftConfig(source="tiny", seed=7)}),
]


@pytest.mark.parametrize("scorer", ["mqa", "batch_expansion"])
@pytest.mark.parametrize(
    "proposer,extra", PROPOSERS, ids=["ngram", "self-draft", "self-draft-own-kv", "tiny-draft"]
)
def test_speculative_greedy_equals_non_speculative(baseline, scorer, proposer, extra):
    rng = random.Random(hash((scorer, proposer, str(extra))) % 1000)
    engine = make_engine(proposer, scorer, seed=rng.randrange(100), **extra)
    total_proposed = total_accepted = 0
    for trial in range(6):
        prompts = random_prompts(rng, 8)
        params = [SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=trial % 2 == 0) for _ in prompts]
        want = baseline.generate(prompts, params)
        reqs = [
            Request(f"t{trial}-{i}", p, SamplingParams(**vars(sp)))
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        for r in reqs:
            engine.add_request(r)
        while engine.has_unfinished:
            engine.step()
        assert [r.output_ids for r in reqs] == want
        total_proposed += sum(r.num_proposed for r in reqs)
        total_accepted += sum(r.num_accepted for r in reqs)
        # the block allocator never leaks
        assert engine.num_free_blocks == engine.num_total_blocks
        assert baseline.num_free_blocks == baseline.num_total_blocks
    assert total_proposed > 0, "the test must actually speculate"
    if proposer == "draft" and extra["draft"].source == "self":
        assert total_accepted > 0


def test_tight_kv_cache_preempts_and_stays_lossless(baseline):
    engine = make_engine("ngram", "mqa", num_blocks=40)
    rng = random.Random(3)
    prompts = random_prompts(rng, 8)
    params = [SamplingParams(max_tokens=30, ignore_eos=True) for _ in prompts]
    want = baseline.generate(prompts, params)
    got = engine.generate(prompts, params)
    assert got == want
    assert engine.scheduler.num_preemptions > 0
    assert engine.num_free_blocks == engine.num_total_blocks


def test_sampled_runs_are_reproducible_with_seeds():
    outs = []
    for _ in range(2):
        engine = make_engine("draft", "mqa", draft=DraftConfig(source="self", num_layers=2))
        sp = [
            SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=20, ignore_eos=True)
            for s in (1, 2, 3)
        ]
        outs.append(engine.generate([[5, 6, 7, 8], [9, 10], [11] * 9], sp))
    assert outs[0] == outs[1]
    assert outs[0][0] != outs[0][1]


@pytest.mark.parametrize(
    "prompt,sp,match",
    [
        ([], SamplingParams(), "prompt is empty"),
        ([1] * 5000, SamplingParams(), "context"),
        ([1, 999], SamplingParams(), "token ids"),
    ],
)
def test_bad_requests_raise_clear_errors(baseline, prompt, sp, match):
    with pytest.raises(ValueError, match=match):
        baseline.add_request(Request("bad", prompt, sp))
    assert not baseline.has_unfinished


def test_unknown_proposer_and_bad_params(baseline):
    with pytest.raises(ValueError, match="unknown proposer 'nope'"):
        baseline.add_request(Request("x", [1, 2], SamplingParams(), SpecParams(proposer="nope")))
    with pytest.raises(ValueError, match="max_k"):
        SpecParams(max_k=-1)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="unknown proposer 'nope'; known: none, ngram"):
        make_engine("nope")


def test_unknown_scorer_names_the_known_ones():
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=64),
        spec=SpecConfig(proposer="ngram", scorers=["mqa", "nope"]),
    )
    with pytest.raises(ValueError, match="unknown scorer 'nope'; known: batch_expansion, mqa"):
        Engine(cfg)
    engine = make_engine("ngram", "mqa_graph")
    engine.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4)))
    engine.step()  # prefill
    with pytest.raises(
        ValueError, match="scorer 'mqa_graph', which is not built here; built: batch_expansion, mqa"
    ):
        engine.step()


def test_step_records_and_abort(baseline):
    records = []
    engine = make_engine("ngram", "batch_expansion")
    engine.on_step = records.append
    engine.add_request(Request("a", [4, 5, 6, 4, 5, 6, 4, 5], SamplingParams(max_tokens=16, ignore_eos=True)))
    engine.add_request(Request("b", [7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True)))
    for _ in range(4):
        engine.step()
    out = engine.abort_request("b")
    assert out is not None and out.finish_reason == "abort"
    while engine.has_unfinished:
        engine.step()
    assert engine.num_free_blocks == engine.num_total_blocks
    decode = [r for r in records if r.kind == "decode"]
    assert decode and all(r.scorer == "batch_expansion" for r in decode)
    assert all(r.score_ms > 0 and r.total_ms >= r.score_ms for r in decode)
    assert sum(len(r.requests) for r in decode) >= len(decode)
    emitted = sum(r.num_emitted for r in records)
    assert emitted >= 16
    for r in decode:  # a run of plain steps (scheduler.decode_steps, a request alone) emits one a forward
        assert sum(q.num_accepted + r.num_decode_steps for q in r.requests) >= r.num_emitted
        assert all(0 <= q.num_accepted <= q.k for q in r.requests)
    assert torch.is_tensor(engine.kv_cache[0][0])


def test_request_larger_than_the_kv_cache_is_capped_not_stuck():
    engine = make_engine("ngram", "mqa", num_blocks=6)  # 5 usable blocks x 4 slots
    out = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(out[0]) == 5 * 4 - 5
    assert engine.num_free_blocks == engine.num_total_blocks
