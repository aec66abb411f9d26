"""bench/determinism_probe.py: the probe on a tiny CPU model, and its divergence report."""

from __future__ import annotations

import argparse

import pytest

from specsched.bench.determinism_probe import (
    RandomPlan,
    divergence_report,
    emitting_step,
    first_divergence,
    policy_of,
    probe,
    request_steps,
)
from specsched.engine.records import StepRecord, StepRequestRecord


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_policy_specs():
    assert policy_of("fixed:8:mqa", ["mqa"]) == {"name": "fixed", "k": 8, "scorer": "mqa"}
    assert policy_of("goodput", ["mqa"]) == {"name": "goodput"}
    assert isinstance(policy_of("random:3", ["mqa"]), RandomPlan)
    with pytest.raises(ValueError, match="fixed:K:SCORER"):
        policy_of("fixed:8", ["mqa"])


def test_the_report_names_the_step_that_emitted_the_first_difference():
    # prompt of 10 tokens; the request's steps: ctx 10 (k 2, 2 accepted: outputs 1..3), ctx 13 (k 4, 0
    # accepted: output 4), ctx 14 (k 0: output 5); the outputs differ from index 4 on
    def step(i: int, ctx: int, k: int, a: int) -> StepRecord:
        return StepRecord(i, "decode", 0.0, 1, k + 1, "mqa", requests=[StepRequestRecord("r", ctx, k, a)])

    records = [StepRecord(0, "prefill", 0.0, 1, 10), step(1, 10, 2, 2), step(2, 13, 4, 0), step(3, 14, 0, 0)]
    steps = request_steps(records, "r", 10)
    assert [s.first_output for s in steps] == [1, 4, 5]
    assert [emitting_step(steps, i) for i in (0, 1, 3, 4, 5)] == [None, 0, 0, 1, 2]
    lines = divergence_report(records, ["r"], [[0] * 10], [[7, 1, 2, 3, 9, 5]], [[7, 1, 2, 3, 4, 5]])
    assert "first difference at output 4: got [9, 5], want [4, 5]" in lines[0]
    assert "step 2: mqa, batch 1, 5 tokens, ctx 13, k 4, accepted 0, offset 0" in lines[1]
    assert "before: step 1: mqa" in lines[2]


def test_the_probe_on_a_tiny_deterministic_model_finds_nothing(capsys):
    args = argparse.Namespace(
        source="tiny", device="cpu", dtype="float32", policy=["fixed:8:mqa", "random:1"],
        scorers=["batch_expansion", "mqa"], reps=1, prompts=[0, 1, 2], ids=True, max_tokens=24,
        max_model_len=256, num_blocks=256, plan_ahead="auto", not_deterministic=False,
    )  # fmt: skip
    lines = probe(args)
    assert [line.split(":")[0] for line in lines] == ["fixed", "random"]
    assert all(" 3/3 equal to non-speculative" in line for line in lines)
