"""The policy sees what a plan that drafts nothing would run (``BatchView.decode_steps``), and goodput,
which weighs runs against speculation with it, stays lossless when it takes them."""

from __future__ import annotations

import random

import pytest

from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.request import SamplingParams
from specsched.policies.base import BatchView, Plan, Policy
from specsched.scorers.graph import GraphConfig, attach_draft_graphs
from tests.engine.test_multi_step import engine, prompts, run


class Spy(Policy):
    """k = 0 for every request; keeps each view."""

    name = "spy_test"

    def __init__(self) -> None:
        self.views: list[BatchView] = []

    def decide(self, view: BatchView, costs) -> Plan:
        self.views.append(view)
        return Plan([0] * view.batch_size, "mqa", self.name)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_the_view_says_how_many_steps_a_plain_plan_runs(decode_steps):
    e = engine("mqa", decode_steps, graphs=False)
    spy = e.policy = Spy()
    max_tokens = 11
    out, recs = run(
        e, [[5, 6, 7], [8, 9, 10, 11]], [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * 2
    )
    assert all(len(o) == max_tokens for o in out)
    assert len(spy.views) == len(recs)
    for view, rec in zip(spy.views, recs):
        assert view.decode_steps == rec.num_decode_steps  # what the engine then ran
    assert max(v.decode_steps for v in spy.views) == decode_steps
    if decode_steps > 1:  # 10 tokens after the prefill's first: 4 + 4 + 4, the last 2 dropped at the stop
        assert [v.decode_steps for v in spy.views] == [4, 4, 4]
        assert [q.num_emitted for q in recs[-1].requests] == [2, 2]


def test_a_request_one_token_from_its_end_does_not_cut_the_run():
    """Its cap is 0 for lack of room, not for lack of drafts: the batch still runs (before, a draft
    proposer's batch ran one plain step at a time whenever some request had one token left)."""
    e = engine("mqa", 4, proposer="draft", graphs=False)
    spy = e.policy = Spy()
    out, recs = run(e, [[5, 6, 7], [8, 9, 10, 11]], [SamplingParams(max_tokens=10, ignore_eos=True)] * 2)
    assert [len(o) for o in out] == [10, 10]
    # 9 tokens after the prefill's first: 4 + 4, then 1 left (a cap of 0), run all the same
    assert [max(r.max_k for r in v.requests) for v in spy.views] == [4, 4, 0]
    assert [v.decode_steps for v in spy.views] == [4, 4, 4]
    assert [q.num_emitted for q in recs[-1].requests] == [1, 1]


def test_an_ngram_request_without_a_match_gets_no_run_in_the_view():
    e = engine("mqa", 4, proposer="ngram", graphs=False)
    spy = e.policy = Spy()
    # random tokens: the n-gram proposer rarely has a match, and then the view offers no run
    rng = random.Random(3)
    run(e, [[rng.randrange(3, 256) for _ in range(9)]], [SamplingParams(max_tokens=8, ignore_eos=True)])
    # a cap of 0 with room left (9 prompt + 8 output tokens): the proposer had nothing on offer
    no_match = [v for v in spy.views if not any(r.max_k > 0 or 17 - r.context_len <= 1 for r in v.requests)]
    assert no_match  # random tokens: most steps have no match
    assert all(v.decode_steps == 1 for v in no_match)


def goodput_engine(proposer: str, decode_steps: int) -> Engine:
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, decode_steps=decode_steps, decode_steps_max_batch=None
        ),
        spec=SpecConfig(proposer=proposer, scorers=["batch_expansion", "mqa"], max_k=4),
        policy={"name": "goodput"},
    )
    return Engine(cfg)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_goodput_with_runs_is_lossless(proposer):
    ps = prompts(random.Random(7), 4)
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * len(ps)
    base = goodput_engine("none", 1).generate(ps, params)
    e = goodput_engine(proposer, 4)
    records = []
    e.on_step = records.append
    assert e.generate(ps, params) == base
    decode = [r for r in records if r.kind == "decode"]
    weighed = [r for r in decode if "run_goodput" in r.plan_info]
    if proposer == "draft":  # a draft model always has drafts on offer: every view offers a run
        assert weighed
    for r in weighed:
        if r.num_decode_steps > 1:  # a run ran: the plan drafted nothing
            assert all(q.k == 0 for q in r.requests)


def test_the_step_after_a_run_says_so():
    """A draft model catches up over the tokens of plain steps (a run, or one) in the next propose:
    that step's record says it came after them (the cost models' propose fit skips it), and no
    other does."""
    e = engine("mqa", 4, proposer="draft", ks=(0, 2, 2, 0, 0, 3), graphs=False)
    out, recs = run(e, [[5, 6, 7, 8]], [SamplingParams(max_tokens=40, ignore_eos=True)])
    assert len(out[0]) == 40
    flags = [r.is_after_run for r in recs]
    drafts = [any(q.k for q in r.requests) for r in recs]
    want = [i > 0 and not drafts[i - 1] and (drafts[i] or r.num_decode_steps > 1) for i, r in enumerate(recs)]
    assert flags == want
    assert any(flags) and not all(flags)
    for r in recs:
        assert r.plan_info.get("is_after_run", False) == r.is_after_run  # what the log reads back
    assert any(r.is_after_run and r.num_proposed for r in recs)  # a drafting step after a run
    assert any(r.is_after_run and r.num_decode_steps > 1 for r in recs)  # and a run after a run


@pytest.mark.parametrize("draft_max_q,eager", [(2, True), (6, False)])
def test_the_drafts_catch_up_after_plain_steps_replays_a_graph(draft_max_q, eager):
    """After a run of plain steps a draft with its own KV cache lags by the run's tokens: with MQA
    buckets up to ``graphs.draft_max_q`` its catch-up replays a graph (emulated here) instead of
    running the model eagerly; the tokens stay the non-speculative ones either way."""
    ps, params = [[5, 6, 7], [9, 10]], [SamplingParams(max_tokens=30, ignore_eos=True)] * 2
    want, _ = run(engine("mqa", 1), ps, params)
    e = engine(
        "mqa", 4, proposer="draft", ks=(2, 0, 3)
    )  # drafting (a prompt of <= 4 to catch up), a run of 4, drafting
    prop = e.proposers["draft"]
    assert not prop.is_shared_kv  # a draft with its own cache: it skips the plain steps
    gcfg = GraphConfig(max_batch=4, max_k=4, max_model_len=256, emulate=True, progress=False,
                       draft_max_q=draft_max_q)  # fmt: skip
    fwd = attach_draft_graphs(prop, gcfg, 4)
    got, recs = run(e, ps, params)
    assert got == want
    assert any(r.is_after_run and any(q.k for q in r.requests) for r in recs)  # drafting after a run
    assert fwd.runner.num_replays > 0
    assert (fwd.num_eager_calls > 0) == eager  # q = 2 + 4 after a run of 4: eager only below 6


@pytest.mark.parametrize("decode_steps,want", [(1, 6), (4, 6), (8, 10)])
def test_the_engines_graph_config_covers_a_run_of_plain_steps(decode_steps, want):
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        scheduler=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, decode_steps=decode_steps, decode_steps_max_batch=None
        ),
    )
    assert GraphConfig.for_engine(cfg, 256).draft_max_q == want
    with pytest.raises(ValueError, match="draft_max_q"):
        GraphConfig(draft_max_q=1)
