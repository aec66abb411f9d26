"""Runs of plain decode steps (``scheduler.decode_steps``): the same greedy tokens as one step at a
time, for every scorer (eager and graph-replayed, emulated on CPU; real graphs on CUDA), across block
boundaries, stops inside a run, sampled requests and speculative steps (which run one step)."""

from __future__ import annotations

import random

import pytest
import torch

from specsched.engine.components import EngineParts
from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.multi_step import num_decode_steps
from specsched.engine.request import Request, SamplingParams, SpecParams
from specsched.models.loader import load_model
from specsched.policies.acceptance import AcceptanceEstimator
from specsched.policies.base import BatchView, Plan, Policy
from specsched.policies.cost_model import CostModels
from specsched.proposers.registry import build_proposers
from specsched.scorers.graph import GraphConfig, graph_buckets_of
from specsched.scorers.registry import build_scorers

BLOCK, NUM_BLOCKS, MAX_LEN = 4, 400, 256


class FixedK(Policy):
    """k per request from a list cycled over the steps (0 = a plain step)."""

    name = "fixed_k_test"

    def __init__(self, scorer: str, ks: list[int]) -> None:
        self.scorer, self.ks, self.n = scorer, ks, 0

    def decide(self, view: BatchView, costs) -> Plan:
        k = self.ks[self.n % len(self.ks)]
        self.n += 1
        return Plan([min(k, r.max_k) for r in view.requests], self.scorer, self.name)


def engine(
    scorer: str,
    decode_steps: int,
    *,
    proposer: str = "none",
    ks=(0,),
    device: str = "cpu",
    graphs=True,
    num_blocks: int = NUM_BLOCKS,
    max_batch: int | None = None,  # scheduler.decode_steps_max_batch
    plain: int = 1,  # scheduler.plain_decode_steps (off: these tests are about decode_steps)
    max_k: int = 4,  # spec.max_k
    plain_ms: float | None = None,  # scheduler.plain_decode_ms (None: no time cap, whatever the CPU's speed)
) -> Engine:
    mcfg = ModelConfig(source="tiny", device=device, dtype="float32")
    model = load_model(mcfg, progress=False).model
    cfg = EngineConfig(
        model=mcfg,
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=64,
            decode_steps=decode_steps,
            decode_steps_max_batch=max_batch,
            plain_decode_steps=plain,
            plain_decode_ms=plain_ms,
        ),  # fmt: skip
        spec=SpecConfig(proposer=proposer, scorers=["batch_expansion", "mqa", "mqa_graph"], max_k=max_k),
    )
    kv = model.allocate_kv_cache(num_blocks, BLOCK)
    gcfg = GraphConfig.for_engine(cfg, MAX_LEN, enabled=graphs, emulate=device == "cpu", progress=False)
    scorers = build_scorers(cfg.spec.scorers, model, kv, BLOCK, gcfg)
    parts = EngineParts(
        model=model, tokenizer=None, kv_cache=kv, num_blocks=num_blocks,
        proposers=build_proposers(cfg.spec, model, num_blocks, BLOCK), scorers=scorers,
        policy=FixedK(scorer, list(ks)), costs=CostModels(graph_buckets_of(scorers)),
        acceptance=AcceptanceEstimator(), model_name="tiny", device=model.lm_head.weight.device,
        max_model_len=MAX_LEN, eos_token_ids=[2],
    )  # fmt: skip
    return Engine(cfg, parts)


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    # lengths 1..30 with block_size 4: a run of steps crosses block boundaries
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 256) for _ in range(rng.randint(2, 5))]
        out.append((motif * 10)[: rng.randint(1, 30)])
    return out


def run(e: Engine, ps: list[list[int]], params: list[SamplingParams]) -> tuple[list[list[int]], list]:
    records = []
    e.on_step = records.append
    out = e.generate(ps, params)
    assert e.num_free_blocks == e.num_total_blocks  # the reserved run's slots are all given back
    return out, [r for r in records if r.kind == "decode"]


# ---- how many steps ---------------------------------------------------------------------------------
def req(prompt_len: int, num_out: int = 0, max_tokens: int = 100, temperature: float = 0.0) -> Request:
    r = Request("r", [5] * prompt_len, SamplingParams(temperature=temperature, max_tokens=max_tokens))
    r.output_ids = [6] * num_out
    return r


def steps(reqs: list[Request], ks: list[int], max_steps: int = 4, caps=None, names=None) -> int:
    caps = [4] * len(reqs) if caps is None else caps
    return num_decode_steps(reqs, ks, caps, names or ["draft"] * len(reqs), max_steps, 256)


def test_num_decode_steps_only_for_plain_greedy_steps_within_the_limits():
    two = [req(10), req(20, 3)]
    assert steps(two, [0, 0]) == 4
    assert steps(two, [0, 0], max_steps=1) == 1  # off
    assert steps(two, [0, 1]) == 1  # a request drafts: one speculative step
    assert steps([req(10), req(5, temperature=0.7)], [0, 0]) == 1  # sampled
    # a request near its max_tokens does not cut a batch's run: the commit drops its tokens past the
    # stop, and a run cut for it would run the other one step at a time
    assert steps([req(10, 5, max_tokens=7), req(3)], [0, 0]) == 4  # 2 tokens left
    # alone, it does: the forwards past its max_tokens would buy nothing
    assert steps([req(10, 6, max_tokens=7)], [0]) == 1
    assert steps([req(10, 4, max_tokens=7)], [0]) == 3
    assert steps([req(10, 2, max_tokens=7)], [0]) == 4
    # the token of the last step sits at position num_tokens - 1 + (S - 1) < max_model_len
    assert steps([req(250)], [0], max_steps=8) == 7
    assert steps([req(256)], [0], max_steps=8) == 1
    assert steps([], []) == 1


def test_a_run_only_when_k_0_is_the_policys_choice():
    two = [req(10), req(20)]
    # an n-gram proposer without a match (cap 0) may have one after the next token: no run
    assert steps(two, [0, 0], caps=[4, 0], names=["ngram", "ngram"]) == 1
    assert steps(two, [0, 0], caps=[4, 2], names=["ngram", "ngram"]) == 4  # drafts declined
    assert steps(two, [0, 0], caps=[0, 0], names=["none", "none"]) == 4  # never drafts
    no_spec = req(20)
    no_spec.spec.max_k = 0  # the request turned speculation off
    assert steps([req(10), no_spec], [0, 0], caps=[3, 0], names=["ngram", "ngram"]) == 4


# ---- the same tokens ---------------------------------------------------------------------------------
@pytest.mark.parametrize("scorer", ["mqa", "batch_expansion", "mqa_graph"])
@pytest.mark.parametrize("steps", [2, 5])
def test_runs_of_plain_steps_give_the_single_step_tokens(scorer, steps):
    rng = random.Random(steps * 7 + len(scorer))
    ps = prompts(rng, 7)  # more than max_num_seqs: requests join as others finish
    # max_tokens not a multiple of the run, EOS (id 2) honoured on odd requests: runs cut short
    params = [SamplingParams(max_tokens=rng.randint(1, 23), ignore_eos=i % 2 == 0) for i in range(len(ps))]
    want, single = run(engine("mqa", 1), ps, params)
    e = engine(scorer, steps)
    got, recs = run(e, ps, params)
    assert got == want
    runs = [r for r in recs if r.num_decode_steps > 1]
    assert runs, "the test must run several steps at once"
    assert len(recs) < len(single)
    for r in runs:
        assert r.plan_info["decode_steps"] == r.num_decode_steps <= steps
        assert r.num_tokens == r.batch_size * r.num_decode_steps
        assert all(q.k == 0 and q.num_accepted == 0 and q.match_bits == "" for q in r.requests)
        # each request keeps the run's tokens up to its stop
        assert all(1 <= q.num_emitted <= r.num_decode_steps for q in r.requests)
        assert r.num_emitted == sum(q.num_emitted for q in r.requests)
    # the context is far: every run of a batch takes its full length, even where a request stops
    # inside it; a request alone runs no further than its max_tokens
    assert all(r.num_decode_steps == steps for r in runs if r.batch_size > 1)
    assert any(r.batch_size > 1 for r in runs)
    assert any(any(q.num_emitted < r.num_decode_steps for q in r.requests) for r in runs)
    if scorer != "mqa":
        runner = e.scorers[scorer].runner
        assert runner.num_replays > 0 and runner.num_eager_fallbacks == 0


def count_waiting(e: Engine) -> dict[int, int]:
    """Wraps ``e.step``: step number -> requests waiting for admission when it began."""
    waiting_at_step: dict[int, int] = {}
    inner = e.step

    def step():
        waiting_at_step[e.num_steps] = len(e.scheduler.waiting)
        return inner()

    e.step = step
    return waiting_at_step


def test_runs_only_while_the_batch_is_small_and_nobody_waits():
    """``scheduler.decode_steps_max_batch=1``: a request decoding alone runs its plain steps in runs,
    a batch of two (or one with a request waiting to be admitted) one step at a time; the tokens are
    the single steps' either way."""
    rng = random.Random(5)
    ps = prompts(rng, 6)  # more than max_num_seqs (4): some wait while others decode
    params = [SamplingParams(max_tokens=rng.randint(8, 20), ignore_eos=True) for _ in ps]
    want, _ = run(engine("mqa", 1), ps, params)
    e = engine("mqa", 4, max_batch=1)
    waiting_at_step = count_waiting(e)
    got, recs = run(e, ps, params)
    assert got == want
    assert any(r.num_decode_steps > 1 for r in recs), "the last request alone must run in runs"
    for r in recs:
        if r.num_decode_steps > 1:
            assert r.batch_size == 1 and waiting_at_step[r.step] == 0
    assert any(r.batch_size > 1 for r in recs) and all(
        r.num_decode_steps == 1 for r in recs if r.batch_size > 1
    )
    alone, _ = run(engine("mqa", 4, max_batch=1), ps[:1], params[:1])  # one request: runs all along
    assert alone == want[:1]
    e = engine("mqa", 4, max_batch=2)
    assert e._runs_allowed(1) and e._runs_allowed(2) and not e._runs_allowed(3)
    e.add_request(Request("w", [5, 6, 7], SamplingParams(max_tokens=4)))  # waits for its prefill
    assert not e._runs_allowed(1)
    assert engine("mqa", 4)._runs_allowed(64)  # null: at any batch
    with pytest.raises(ValueError, match="scheduler.decode_steps_max_batch must be >= 1 or null, got 0"):
        SchedulerConfig(decode_steps_max_batch=0)


def test_max_tokens_inside_a_run_stops_the_request_there_and_the_others_run_on():
    ps = [[7, 8, 9, 10], [11, 12, 13], [14, 15]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (3, 13, 9)]
    want, _ = run(engine("mqa", 1), ps, params)
    got, recs = run(engine("mqa", 4), ps, params)
    assert got == want and [len(o) for o in got] == [3, 13, 9]
    # the first decode step: 2 tokens left for the first request, yet the batch runs 4 steps
    first = recs[0]
    assert first.num_decode_steps == 4
    assert [q.num_emitted for q in first.requests] == [2, 4, 4]
    # every run but the last request's tail ran the full length
    assert all(r.num_decode_steps == 4 for r in recs[:-1])


def test_eos_inside_a_run_stops_the_request_there():
    rng = random.Random(11)
    ps = prompts(rng, 12)
    params = [SamplingParams(max_tokens=40) for _ in ps]  # EOS honoured
    base = engine("mqa", 1)
    base.eos_token_ids = {t for out in run(engine("mqa", 1), ps, params)[0] for t in out[3:4]}  # real ids
    want, _ = run(base, ps, params)
    e = engine("batch_expansion", 4)
    e.eos_token_ids = set(base.eos_token_ids)
    got, recs = run(e, ps, params)
    assert got == want
    stopped = [out for out in got if len(out) < 40]
    assert stopped, "some request must stop at an EOS"
    assert any(q.num_emitted < r.num_decode_steps for r in recs if r.num_decode_steps > 1 for q in r.requests)


def test_speculative_and_sampled_steps_run_one_step():
    rng = random.Random(5)
    ps = prompts(rng, 4)
    params = [SamplingParams(max_tokens=16, ignore_eos=True) for _ in ps]
    want, _ = run(engine("mqa", 1), ps, params)
    # n-gram drafts every other step: the drafting steps run alone, the plain ones in runs
    got, recs = run(engine("mqa_graph", 3, proposer="ngram", ks=[3, 0]), ps, params)
    assert got == want
    assert any(r.num_decode_steps > 1 for r in recs)
    assert all(r.num_decode_steps == 1 for r in recs if any(q.k for q in r.requests))
    # a sampled request in the batch: every step is one step, and the seeded output is unchanged
    sp = [SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)] + params[1:]
    want, _ = run(engine("mqa", 1), ps, sp)
    got, recs = run(engine("mqa", 4), ps, sp)
    assert got == want
    assert all(r.num_decode_steps == 1 for r in recs if r.batch_size == len(ps))


def test_a_tight_cache_falls_back_to_single_steps_and_stays_lossless():
    rng = random.Random(9)
    ps = [p + [7] * 20 for p in prompts(rng, 4)]  # 21-50 tokens: 6-13 blocks of 4 each
    params = [SamplingParams(max_tokens=30, ignore_eos=True) for _ in ps]
    want, _ = run(engine("mqa", 1), ps, params)
    e = engine("batch_expansion", 4, num_blocks=40)  # 39 usable blocks: 4 requests do not all fit
    reserve, short = e.scheduler.reserve_lookahead, []

    def spy(batch, ks):  # runs that did not get their slots
        kept, got = reserve(batch, ks)
        if any(ks) and (len(kept) < len(batch) or got != ks):
            short.append(e.num_steps)
        return kept, got

    e.scheduler.reserve_lookahead = spy
    got, recs = run(e, ps, params)
    assert got == want
    assert e.scheduler.num_preemptions > 0 and short, "the cache must refuse some run its slots"
    assert any(r.num_decode_steps > 1 for r in recs)
    assert all(r.num_decode_steps == 1 for r in recs if r.step in short)  # those ran one step


def test_a_request_that_cannot_draft_runs_alone_by_default():
    """``scheduler.plain_decode_steps`` (8 by default, whatever ``decode_steps`` says): a decode batch
    of one request that cannot draft (proposer none, or its spec.max_k 0) with none waiting runs its
    plain steps in runs; a request that can draft (n-gram), a batch of two, or a request waiting for
    admission keeps single steps. The tokens are the single steps' either way."""
    rng = random.Random(11)
    ps = prompts(rng, 6)  # more than max_num_seqs (4): some wait while others decode
    params = [SamplingParams(max_tokens=rng.randint(9, 20), ignore_eos=True) for _ in ps]
    want, _ = run(engine("mqa", 1), ps, params)
    defaults = SchedulerConfig()
    assert (defaults.plain_decode_steps, defaults.decode_steps, defaults.decode_steps_max_batch) == (8, 8, 1)
    # below with decode_steps=1: plain_decode_steps runs whatever decode_steps says
    e = engine("mqa", 1, plain=SchedulerConfig().plain_decode_steps)
    waiting_at_step = count_waiting(e)
    got, recs = run(e, ps, params)
    assert got == want
    runs = [r for r in recs if r.num_decode_steps > 1]
    assert runs, "the last request alone must run in runs"
    assert all(r.batch_size == 1 and waiting_at_step[r.step] == 0 and r.num_decode_steps <= 8 for r in runs)
    assert all(r.num_decode_steps == 1 for r in recs if r.batch_size > 1)
    # n-gram requests can draft: alone they step one at a time (k = 0 here is the policy's choice)
    got, recs = run(engine("mqa", 1, proposer="ngram", plain=8), ps[:1], params[:1])
    assert got == want[:1] and all(r.num_decode_steps == 1 for r in recs)
    # ... unless the request turned speculation off
    e = engine("mqa", 1, proposer="ngram", plain=8)
    r0 = Request("off", ps[0], params[0], SpecParams(max_k=0))
    e.add_request(r0)
    recs = []
    e.on_step = recs.append
    while not r0.is_finished:
        e.step()
    assert r0.output_ids == want[0] and any(r.num_decode_steps > 1 for r in recs)
    # ... or the engine's spec.max_k is 0 (speculation off for every request)
    got, recs = run(engine("mqa", 1, proposer="ngram", plain=8, max_k=0), ps[:1], params[:1])
    assert got == want[:1] and any(r.num_decode_steps > 1 for r in recs)
    with pytest.raises(ValueError, match="scheduler.plain_decode_steps must be >= 1, got 0"):
        SchedulerConfig(plain_decode_steps=0)


def test_a_run_alone_lasts_about_plain_decode_ms_at_most():
    """``scheduler.plain_decode_ms``: the run's length is plain_decode_steps capped by the bound over the
    measured ms of a plain forward alone (one step before any is measured), at least 1; the forwards
    are measured (a run's time over its forwards) and the tokens are the single steps'."""
    assert SchedulerConfig().plain_decode_ms == 8.0
    with pytest.raises(ValueError, match="scheduler.plain_decode_ms must be > 0 or null, got 0"):
        SchedulerConfig(plain_decode_ms=0)
    e = engine("mqa", 1, plain=8, plain_ms=8.0)
    assert e._plain_forward_ms is None and e._plain_steps() == 1  # nothing measured: one step
    for fwd_ms, want in ((0.5, 8), (0.96, 8), (2.0, 4), (3.0, 2), (7.5, 1), (20.0, 1)):
        e._plain_forward_ms = fwd_ms
        assert e._plain_steps() == want, fwd_ms
    assert engine("mqa", 1, plain=8, plain_ms=None)._plain_steps() == 8  # no cap
    rng = random.Random(3)
    ps = prompts(rng, 1)
    params = [SamplingParams(max_tokens=20, ignore_eos=True)]
    want, _ = run(engine("mqa", 1), ps, params)
    e = engine("mqa", 1, plain=8, plain_ms=1e-6)  # no forward is that fast: one step at a time
    got, recs = run(e, ps, params)
    assert got == want and all(r.num_decode_steps == 1 for r in recs)
    assert e._plain_forward_ms is not None and e._plain_forward_ms > 0  # measured all along
    e = engine("mqa", 1, plain=8, plain_ms=1e6)  # any forward fits: runs of 8 once one is measured
    got, recs = run(e, ps, params)
    assert got == want and recs[0].num_decode_steps == 1 and max(r.num_decode_steps for r in recs) == 8


def test_a_decode_steps_run_alone_lasts_about_plain_decode_ms_too():
    """A request alone whose plan drafts nothing (a draft model declined: fixed k = 0) runs
    ``decode_steps`` capped by ``plain_decode_ms`` over the measured plain forward, as a request that
    cannot draft does: a 7B target's forward of ~7 ms makes a newcomer wait one forward, not eight.
    In a batch the cap does not apply (its forwards are not a forward alone)."""
    rng = random.Random(5)
    ps = prompts(rng, 1)
    params = [SamplingParams(max_tokens=20, ignore_eos=True)]
    want, _ = run(engine("mqa", 1, proposer="draft"), ps, params)
    e = engine("mqa", 8, proposer="draft", plain_ms=1e-6)  # no forward is that fast: single steps
    got, recs = run(e, ps, params)
    assert got == want and all(r.num_decode_steps == 1 for r in recs)
    e = engine("mqa", 8, proposer="draft", plain_ms=1e6)  # runs of 8 once a forward is measured
    got, recs = run(e, ps, params)
    assert got == want and recs[0].num_decode_steps == 1 and max(r.num_decode_steps for r in recs) == 8
    e = engine("mqa", 8, proposer="draft", plain_ms=8.0)
    e._plain_forward_ms = 2.0
    assert e._plain_steps(8) == 4 and e._plain_steps(3) == 3  # what the view offers at ~2 ms a forward


def test_a_run_is_not_a_cost_model_observation():
    e = engine("mqa", 4)
    _, recs = run(e, prompts(random.Random(2), 3), [SamplingParams(max_tokens=10, ignore_eos=True)] * 3)
    runs = [r for r in recs if r.num_decode_steps > 1]
    assert runs and not any(e.costs.observe(r) for r in runs)
    one = engine("mqa", 1)
    _, singles = run(one, prompts(random.Random(2), 3), [SamplingParams(max_tokens=10, ignore_eos=True)] * 3)
    assert one.costs.observe(singles[0])  # a single plain step is one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scorer", ["batch_expansion", "mqa_graph"])
def test_runs_on_cuda_graphs_give_the_single_step_tokens(scorer):
    rng = random.Random(1)
    ps = prompts(rng, 6)
    params = [SamplingParams(max_tokens=rng.randint(5, 30), ignore_eos=True) for _ in ps]
    want, _ = run(engine(scorer, 1, device="cuda"), ps, params)
    e = engine(scorer, 4, device="cuda")
    got, recs = run(e, ps, params)
    assert got == want
    assert any(r.num_decode_steps == 4 for r in recs)
    assert e.scorers[scorer].runner.num_eager_fallbacks == 0


def test_a_run_wakes_the_device_wait_hook_after_its_first_forward_once():
    """The hook (the daemon's IO thread: a new request's first token) goes after a run's first
    forward is queued, not after the host has launched them all; still once per step."""
    e = engine("batch_expansion", 4)
    events: list[str] = []
    scorer = e.scorers["batch_expansion"]
    real_forward = scorer.decode_forward

    def forward(x, ids):
        events.append("forward")
        return real_forward(x, ids)

    scorer.decode_forward = forward
    e.on_device_wait = lambda: events.append("wait")
    e.on_step = lambda rec: events.append(f"{rec.kind}:{rec.num_decode_steps}")
    e.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=9, ignore_eos=True))
    groups, cur = [], []  # each step's events, its record last
    for ev in events:
        cur.append(ev)
        if ":" in ev:
            groups.append(cur)
            cur = []
    runs = [g for g in groups if g[-1] == "decode:4"]
    assert runs, events
    for g in runs:  # the first forward, the hook, the other three, the record
        assert g == ["forward", "wait", "forward", "forward", "forward", "decode:4"], g
    assert all(g.count("wait") == 1 for g in groups)  # one a step, runs or not
