"""bench/acceptance_table.py: first-draft acceptance by state and cap, by depth, and calibration."""

from __future__ import annotations

import pytest

from specsched.bench.acceptance_table import (
    acceptance_markdown,
    calibration,
    depth_acceptance,
    first_draft_counts,
    step_state,
)
from specsched.engine.records import StepRecord, StepRequestRecord


def steps_of(rows: list[list[tuple[str, int, int, int]]]) -> list[StepRecord]:
    """One decode step per inner list of (request id, k, accepted, cap)."""
    return [
        StepRecord(i, "decode", 0.0, len(reqs), 0, "mqa", "fixed", "ngram",
                   requests=[StepRequestRecord(r, 10 + i, k, a, max_k=cap) for r, k, a, cap in reqs])
        for i, reqs in enumerate(rows)
    ]  # fmt: skip


def test_step_state_from_the_step_before():
    assert [step_state(x) for x in (None, (0, 0), (3, 3), (3, 1))] == ["first", "none", "full", "rejected"]


def test_first_draft_counts_by_state_and_cap():
    steps = steps_of([
        [("a", 2, 2, 5), ("b", 0, 0, 0)],  # a: first, cap 5, accepted; b: no drafts (not counted)
        [("a", 3, 0, 3), ("b", 2, 1, 9)],  # a: full, cap 3, rejected; b: none, cap 9 -> 8, accepted
        [("a", 1, 1, 3), ("b", 1, 0, 8)],  # a: rejected, cap 3, accepted; b: rejected, cap 8, rejected
    ])  # fmt: skip
    assert first_draft_counts(steps) == {
        ("first", 5): [1, 1], ("full", 3): [1, 0], ("none", 8): [1, 1], ("rejected", 3): [1, 1],
        ("rejected", 8): [1, 0],
    }  # fmt: skip


def test_depth_acceptance_counts_only_the_drafts_reached():
    # k=3 a=1: draft 0 accepted, draft 1 rejected, draft 2 never reached; k=2 a=2: both accepted
    steps = steps_of([[("a", 3, 1, 8)], [("a", 2, 2, 8)]])
    assert depth_acceptance(steps) == {0: (2, 2), 1: (2, 1)}


def test_calibration_compares_the_estimators_expectation_with_what_was_emitted():
    # the estimator's prior for n-gram is Beta(1, 2): mean 1/3 before the first step
    steps = steps_of([[("a", 1, 1, 8)]])
    (n, expected, emitted) = calibration(steps, "ngram")[1]
    assert n == 1 and emitted == 2 and expected == pytest.approx(1 + 1 / 3)
    text = acceptance_markdown("log", steps, "ngram")
    assert "| first | 1.00 | 1 | 1.00 (1) |" in text and "expected / emitted tokens 0.667" in text
