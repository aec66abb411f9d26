"""The recorded policy's decide spill (policies/replay.py: decide_spill_ms) is read off a real log,
taken out of the costs a policy that does not decide ahead is replayed with, and kept for one that does."""

from __future__ import annotations

import dataclasses
import sqlite3

import pytest

from specsched.policies.registry import build_policy
from specsched.policies.replay_costs import costs_for, decide_spill_ms, refit_costs
from specsched.policies.replay_log import load_run
from specsched.policies.shapes import StepShape

from .test_replay import CONFIG, decode_step, write_log

AHEAD = {"is_planned_ahead": True, "plan_age": 0}


def step(i: int, batch: int, post: float, info: dict | None = None, total: float = 9.0):
    """A decode step of ``batch`` requests whose overlap + verify host ms sum to ``post``."""
    rec = decode_step(i, [(f"r{j}", 20 + i, 1, 1) for j in range(batch)])
    return dataclasses.replace(
        rec,
        total_ms=total,
        plan_info=dict(info or {}),
        host_ms={"overlap": post / 2, "verify": post / 2, "x": 1.0},
    )


def test_spill_is_a_deciding_steps_post_launch_time_beyond_its_batch_sizes_median():
    steps = [
        step(0, 2, 1.0),
        step(1, 2, 3.5),  # decided ahead: step 2 runs the fresh plan
        step(2, 2, 1.2, AHEAD),
        step(3, 2, 0.8, {"is_planned_ahead": True, "plan_age": 1}),  # a carried plan: 2 did not decide
        step(4, 4, 2.0),  # decided ahead, but no step of batch 4 decided nothing ahead: no median
        step(5, 2, 1.0, AHEAD),
        step(7, 2, 5.0),  # no step 8: step 9, decided ahead, follows a gap, so 7 decided nothing
        step(9, 2, 0.9, AHEAD),
        step(10, 2, 20.0, total=4.0),  # decided ahead, capped at its total
        step(11, 2, 1.0, AHEAD),
    ]
    spill = decide_spill_ms(steps)
    # batch-2 steps that decided nothing ahead: 0, 2, 3, 5, 7, 9, 11 -> median of their post times 1.0
    assert spill == pytest.approx({1: 2.5, 10: 4.0})
    assert decide_spill_ms([step(0, 2, 1.0), step(1, 2, 2.0)]) == {}


def test_a_log_reads_back_only_the_plan_ahead_keys_and_survives_bad_plan_info(tmp_path):
    path = tmp_path / "log.sqlite"
    steps = [
        step(0, 2, 1.0, {"reason": "x", "scorer_goodput": {"mqa": 1.0}}),
        step(1, 2, 3.0),
        step(2, 2, 1.0, AHEAD),
    ]
    write_log(path, CONFIG, steps, [("r0", 20, 4), ("r1", 20, 4)])
    db = sqlite3.connect(path)
    db.execute("update steps set plan_info = '{not json' where step = 0")
    db.commit()
    db.close()
    run = load_run(str(path))
    assert [s.plan_info for s in run.decode_steps] == [{}, {}, AHEAD]
    assert decide_spill_ms(run.decode_steps) == pytest.approx({1: 2.0})


def test_a_policy_that_does_not_decide_ahead_is_replayed_without_the_spill(tmp_path):
    path = tmp_path / "log.sqlite"
    steps = []
    for i in range(0, 60, 3):  # every third step decides ahead and runs 6 ms longer
        steps += [step(i, 2, 1.0, AHEAD if i else None), step(i + 1, 2, 1.0), step(i + 2, 2, 7.0, total=15.0)]
    write_log(path, CONFIG, steps, [("r0", 20, 4), ("r1", 20, 4)])
    run = load_run(str(path))
    spill = decide_spill_ms(run.decode_steps)
    assert len(spill) == 19 and all(v == pytest.approx(6.0) for v in spill.values())
    with_spill = refit_costs(run)
    without = refit_costs(run, without_decide_spill=True)
    shape = StepShape([1, 1], [30, 30])
    gap = with_spill.predict("mqa", "draft", shape).total_ms - without.predict("mqa", "draft", shape).total_ms
    assert gap == pytest.approx(6.0 * 19 / 60, rel=0.15)  # the spill's mean over the steps
    fixed, goodput = (
        build_policy({"name": "fixed", "k": 1, "scorer": "mqa"}),
        build_policy({"name": "goodput"}),
    )
    assert costs_for(fixed, with_spill, without) is without
    assert costs_for(goodput, with_spill, without) is with_spill
    assert costs_for(fixed, with_spill, None) is with_spill


def test_replay_fidelity_loads_both_cost_models_unless_told_to_keep_the_spill(tmp_path):
    from specsched.bench.replay_fidelity import load_log

    path = tmp_path / "log.sqlite"
    steps = [step(0, 2, 1.0), step(1, 2, 4.0, total=12.0), step(2, 2, 1.0, AHEAD), step(3, 2, 1.0)]
    write_log(path, CONFIG, steps, [("r0", 20, 4), ("r1", 20, 4)])
    assert load_log(str(path)).costs_without_spill is not None
    assert load_log(str(path), decide_spill=False).costs_without_spill is None
    plain = tmp_path / "plain.sqlite"
    write_log(plain, CONFIG, [step(i, 2, 1.0) for i in range(4)], [("r0", 20, 4), ("r1", 20, 4)])
    assert load_log(str(plain)).costs_without_spill is None  # nothing decided ahead: one model
