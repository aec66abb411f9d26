"""The policy's own CPU time per step is visible (issue 13): the engine times every ``decide`` —
on time and planned ahead — into the step's ``plan_info`` (the decision log's JSON column)."""

from __future__ import annotations

import json

import pytest

from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.records import StepRecord
from specsched.engine.request import SamplingParams


@pytest.mark.parametrize("plan_ahead,policy", [("on", "goodput"), ("off", "fixed")])
def test_every_decode_record_carries_its_decide_ms(plan_ahead, policy):
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=128),
        # decide_budget None: a decide every step (a budget carries plans for a timing-led while)
        scheduler=SchedulerConfig(
            max_num_seqs=2, max_num_batched_tokens=64, plan_ahead=plan_ahead, decide_budget=None
        ),
        spec=SpecConfig(proposer="ngram", scorers=["batch_expansion", "mqa"], max_k=3),
        policy={"name": policy},
    )
    engine = Engine(cfg)
    records: list[StepRecord] = []
    engine.on_step = records.append
    engine.generate([[5, 6, 7, 8] * 5, [9, 10, 11] * 6], SamplingParams(max_tokens=12, ignore_eos=True))
    decode = [r for r in records if r.kind == "decode"]
    assert decode
    for rec in decode:
        ms = json.loads(json.dumps(rec.plan_info))["decide_ms"]
        assert isinstance(ms, float) and 0.0 <= ms < 1000.0
    if plan_ahead == "on":
        assert any(r.plan_info.get("is_planned_ahead") for r in decode)
