"""The decode step queues its verification right behind the scoring forward, before the host's
overlapped work (the next step's decide ahead), and reads it after; the device-wait hook runs only
when the read may still wait. Greedy output stays the non-speculative output."""

from __future__ import annotations

import torch

from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.request import SamplingParams
from specsched.kernels.pending_read import PendingRead

PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7, [12, 13, 14, 15, 16] * 5]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


def make_engine(policy: dict) -> Engine:
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, plan_ahead="on"),
        spec=SpecConfig(proposer="ngram", scorers=["batch_expansion", "mqa"], max_k=4),
        policy=policy,
    )
    return Engine(cfg)


def trace_calls(engine: Engine) -> list[str]:
    calls: list[str] = []
    for name in ("_score", "_launch_verify", "_while_scoring", "_read_verify"):
        inner = getattr(engine, name)

        def traced(*args, _inner=inner, _name=name, **kw):
            calls.append(_name)
            return _inner(*args, **kw)

        setattr(engine, name, traced)
    return calls


def test_verification_is_queued_before_the_overlap_and_read_after():
    engine = make_engine({"name": "goodput"})
    calls = trace_calls(engine)
    out = engine.generate(PROMPTS, GREEDY)
    at = [i for i, c in enumerate(calls) if c == "_while_scoring"]  # one per decode step
    assert len(at) >= 10
    for i in at:  # prefill steps launch and read too, without a scoring forward or an overlap
        assert calls[i - 2 : i + 2] == ["_score", "_launch_verify", "_while_scoring", "_read_verify"]
    assert calls.count("_launch_verify") == calls.count("_read_verify")
    base = make_engine({"name": "fixed", "k": 0, "scorer": "batch_expansion"}).generate(PROMPTS, GREEDY)
    assert out == base


class FakePending(PendingRead):
    def __init__(self, is_done: bool) -> None:
        super().__init__(torch.tensor([[1, 2], [3, 4]]), lambda rows: (rows, ["", ""]))
        self._is_done = is_done

    @property
    def is_done(self) -> bool:
        return self._is_done


def test_the_device_wait_hook_runs_only_while_the_read_may_wait():
    engine = make_engine({"name": "goodput"})
    woken: list[int] = []
    engine.on_device_wait = lambda: woken.append(1)
    assert engine._read_verify(FakePending(is_done=False)) == ([[1, 2], [3, 4]], ["", ""])
    assert woken == [1]
    assert engine._read_verify(FakePending(is_done=True)) == ([[1, 2], [3, 4]], ["", ""])
    assert woken == [1]  # the device was done: nothing to overlap, the woken threads would hold the lock
