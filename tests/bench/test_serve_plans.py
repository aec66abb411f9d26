"""bench/serve_plans.py: decode steps by where their plan came from, from real decision logs."""

from __future__ import annotations

import pytest

from specsched.bench.serve_plans import decide_cost_ms, plan_kind, plan_rows, plan_table
from specsched.daemon.log import LogWriter
from specsched.daemon.log_config import LogConfig
from specsched.engine.records import StepRecord

CARRIED = (
    {"plan_age": 2},
    {"between": 0.04, "first_event": 0.02, "score": 0.22, "overlap": 0.11, "verify": 0.79},
)
DECIDING = (
    {"plan_age": 3},
    {"between": 0.04, "first_event": 0.02, "score": 0.22, "overlap": 0.72, "verify": 0.27},
)
AHEAD = ({"plan_age": 0, "is_planned_ahead": True, "decide_ms": 0.6, "decide_cpu_ms": 0.4},
         {"between": 0.05, "first_event": 0.03, "score": 0.38, "overlap": 0.11, "verify": 0.78})  # fmt: skip
ON_STEP = (
    {"plan_age": 0, "decide_ms": 1.2},  # a log from before decide_cpu_ms
    {"between": 0.04, "first_event": 0.03, "score": 0.26, "overlap": 0.03, "verify": 0.85},
)


def write_log(path, steps: list[tuple[int, dict, dict, float]]) -> str:
    """A log of decode steps (batch size, plan_info, host_ms, step ms) numbered 1.., after a prefill."""
    log = LogWriter(LogConfig(path=str(path)))
    log.start_run({"config": "test"}, model="tiny", device="cpu", version="test")
    log.write_step(StepRecord(0, "prefill", 0.0, 1, 30, score_ms=3.0, total_ms=3.5))
    for i, (batch, info, host, total) in enumerate(steps, 1):
        rec = StepRecord(i, "decode", float(i), batch, 20, "mqa_graph", score_ms=1.1, total_ms=total)
        rec.plan_info, rec.host_ms = dict(info), dict(host)
        log.write_step(rec)
    assert log.flush()
    log.close()
    return str(path)


def test_plan_kind_as_defined():
    assert plan_kind({"plan_age": 0, "is_planned_ahead": True}, is_next_ahead=True) == "ahead"
    assert plan_kind({"plan_age": 0}, is_next_ahead=False) == "on step"
    assert plan_kind({"plan_age": 4}, is_next_ahead=True) == "deciding"
    assert plan_kind({"plan_age": 4}, is_next_ahead=False) == "carried"
    assert plan_kind({}, is_next_ahead=False) == "on step"  # a policy that decides every step (fixed)


def test_rows_split_steps_by_plan_and_price_a_decide_ahead(tmp_path):
    # per cycle of 5 steps at batch 4: three carried, one whose scoring held a decide, the one after it
    cycle = [(4, *CARRIED, 1.40)] * 3 + [(4, *DECIDING, 1.49), (4, *AHEAD, 1.53)]
    steps = [(4, *ON_STEP, 2.2)] + cycle * 8 + [(1, *CARRIED, 1.2)] * 3
    rows = plan_rows(write_log(tmp_path / "goodput.sqlite", steps), "goodput", [1, 4])
    got = {(r["concurrency"], r["kind"]): r for r in rows}
    assert got[(4, "carried")]["num_steps"] == 24 and got[(4, "deciding")]["num_steps"] == 8
    assert got[(4, "ahead")]["num_steps"] == 8 and got[(4, "on step")]["num_steps"] == 1
    assert got[(4, "ahead")]["share"] == pytest.approx(8 / 41)
    assert got[(4, "ahead")]["spill_ms"] == pytest.approx(0.05 + 0.03 + 0.38)
    assert got[(4, "deciding")]["post_ms"] == pytest.approx(0.72 + 0.27)
    assert got[(4, "carried")]["step_ms"] == 1.40
    at4 = [r for r in rows if r["concurrency"] == 4]
    # (0.99 - 0.90) after the deciding launch + (0.46 - 0.28) in the next step's spill phases
    assert decide_cost_ms(at4) == pytest.approx(0.09 + 0.18)
    assert [r["kind"] for r in rows if r["concurrency"] == 1] == ["carried"]
    assert decide_cost_ms([r for r in rows if r["concurrency"] == 1]) is None
    text = plan_table(rows)
    line = next(x for x in text.splitlines() if x.startswith("| goodput | 4 |"))
    assert line.endswith("| 0.270 | 0.600 / 0.400 (9) |") and "59 %, 1.400 / 0.280 / 0.900" in line, text
    # the decides of an N: eight ahead at 0.6 ms (0.4 of CPU) and one on the step (1.2, no CPU time)
    assert (got[(4, "carried")]["num_decides"], got[(4, "carried")]["decide_ms"]) == (9, 0.6)
    assert got[(4, "carried")]["decide_cpu_ms"] == 0.4 and got[(1, "carried")]["num_decides"] == 0


def test_no_table_without_a_decide_ahead(tmp_path):
    fixed = write_log(tmp_path / "fixed.sqlite", [(4, {}, ON_STEP[1], 1.4)] * 5)
    rows = plan_rows(fixed, "k=8", [4])
    assert [(r["kind"], r["num_steps"]) for r in rows] == [("on step", 5)]
    assert plan_table(rows) == ""
    assert plan_rows(tmp_path / "missing.sqlite", "x", [4]) == []
