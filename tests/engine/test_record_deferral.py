"""``Engine.is_record_deferred`` (set by the daemon with ``daemon.output_pace=window``): a decode step's
record is completed in the next step's host window (or at once when the engine idles), not before the
step returns. The records, their order, the policy's plans and the greedy output are what they are
without it."""

from __future__ import annotations

import dataclasses

from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.records import StepRecord
from specsched.engine.request import Request, SamplingParams

PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7, [12, 13, 14, 15, 16] * 5, [3, 4] * 9]
# what the clock decides: the times, and the cost models' predictions made from them
TIMING = {"start_time", "propose_ms", "score_ms", "verify_ms", "total_ms", "host_ms", "plan_info"}
TIMING |= {"predicted_propose_ms", "predicted_score_ms", "predicted_verify_ms", "predicted_ms"}


def make_engine(policy: dict, is_deferred: bool) -> Engine:
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        spec=SpecConfig(proposer="ngram", scorers=["batch_expansion", "mqa"], max_k=4),
        policy=policy,
    )
    engine = Engine(cfg)
    engine.is_record_deferred = is_deferred
    return engine


def serve(engine: Engine) -> tuple[list[tuple[bool, StepRecord]], dict[str, list[int]]]:
    """Step the engine over PROMPTS (arriving two at a time); each record with whether on_step gave
    it inside a decode step's host window, and each request's tokens."""
    recs: list[tuple[bool, StepRecord]] = []
    window = [False]
    inner = engine._while_scoring

    def while_scoring(*args):
        window[0] = True
        try:
            inner(*args)
        finally:
            window[0] = False

    engine._while_scoring = while_scoring
    engine.on_step = lambda rec: recs.append((window[0], rec))
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(Request(f"r{i}", list(p), SamplingParams(max_tokens=14 + 3 * i, ignore_eos=True)))
        if i % 2:
            for _ in range(3):
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return recs, tokens


def fields(rec: StepRecord) -> dict:
    d = dataclasses.asdict(rec)
    return {k: v for k, v in d.items() if k not in TIMING}


def test_deferred_records_are_the_same_records_one_window_later():
    policy = {"name": "fixed", "k": 3, "scorer": "mqa"}  # a plan the clock does not change
    now_recs, now_tokens = serve(make_engine(policy, False))
    late_recs, late_tokens = serve(make_engine(policy, True))
    assert late_tokens == now_tokens and len(now_tokens) == len(PROMPTS)
    assert [fields(r) for _, r in late_recs] == [fields(r) for _, r in now_recs]
    assert sum(r.num_proposed for _, r in late_recs) > 0
    assert [r.step for _, r in late_recs] == list(range(len(late_recs)))  # in order, none lost
    # without deferral each record comes as its step ends; deferred, a decode record comes in the next
    # decode step's window, or before a prefill step, or at the end of its own step when the engine
    # idles after it (the last one)
    assert not any(is_in for is_in, _ in now_recs)
    decode = [(is_in, r) for is_in, r in late_recs if r.kind == "decode"]
    num_prefills = sum(r.kind == "prefill" for _, r in late_recs)
    assert sum(is_in for is_in, _ in decode) >= len(decode) - num_prefills - 1 > 0
    assert not any(is_in for is_in, r in late_recs if r.kind == "prefill")
    assert late_recs[-1][1].kind == "decode" and not late_recs[-1][0]


def test_goodput_with_deferred_records_keeps_the_greedy_output():
    plain = serve(make_engine({"name": "fixed", "k": 0, "scorer": "batch_expansion"}, False))[1]
    recs, tokens = serve(make_engine({"name": "goodput"}, True))
    assert tokens == plain
    assert [r.step for _, r in recs] == list(range(len(recs)))
    assert sum(r.num_proposed for _, r in recs) > 0


def test_an_idle_call_or_a_prefill_completes_a_deferred_record_first():
    engine = make_engine({"name": "fixed", "k": 2, "scorer": "batch_expansion"}, True)
    recs: list[StepRecord] = []
    engine.on_step = recs.append
    engine.add_request(Request("a", [5, 6, 7, 8] * 4, SamplingParams(max_tokens=30, ignore_eos=True)))
    engine.step()  # prefill
    engine.step()  # decode: its record waits
    assert [r.kind for r in recs] == ["prefill"] and engine._unrecorded is not None
    engine.add_request(Request("b", [9, 10] * 6, SamplingParams(max_tokens=4, ignore_eos=True)))
    engine.step()  # b's prefill: the decode record goes first
    assert [r.kind for r in recs] == ["prefill", "decode", "prefill"]
    assert recs[1].batch_size == 1 and recs[1].requests[0].request_id == "a"
