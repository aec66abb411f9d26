"""How often the decide budget would re-decide on a recorded serve run, under each decide-cost measure.

``python -m specsched.bench.plan_interval LOG [--concurrency 4 16] [--budget 0.02] [--max-age 16]``
feeds the decode steps of batch size N of the log's last run, in order, through
:meth:`specsched.engine.planning.Planner.observe` as the engine does: a step whose next step ran a
plan decided ahead (``plan_info.is_planned_ahead``) held that decide, its ms the plan's
``decide_ms``. It prints, per N and measure (``scheduler.decide_cost`` ``step``: the deciding step's
wait alone; ``exposed``: with the next step's spill, engine/planning.py), the median exposed ms a
decide is charged and the median and mean interval (steps per decide) the budget then asks for.
Open loop: the recorded steps decided at the recorded rate, so this is what the measure would say
of them, not what a run under it would do. Only decides ahead are fed (a decide on the step charges
its own ms under every measure): batches up to ``scheduler.plan_ahead_max_batch``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from specsched.bench.markdown import fmt, table
from specsched.bench.serve_plans import decode_steps
from specsched.engine.planning import Planner

MEASURES = {"step": False, "exposed": True}  # decide_cost -> is the next step's spill counted


def interval_rows(log_path: str | Path, concurrency: list[int], budget: float, max_age: int) -> list[dict]:
    """Per N and measure: the median exposed ms and the median / mean interval over the steps."""
    steps = decode_steps(log_path)
    out = []
    for n in concurrency:
        for measure, is_spill in MEASURES.items():
            planner = Planner(budget, max_age, is_plan_ahead=True, is_spill_counted=is_spill)
            exposed, intervals = [], []
            for s in steps:
                if s.batch_size != n:
                    continue
                if s.is_next_ahead:
                    planner._ahead_ms = float(
                        s.next_info.get("decide_ms") or 0.0
                    )  # the decide this step held
                planner.observe(s.score_ms, s.host_ms)
                if planner.reuse.exposed_ms is not None:
                    exposed.append(planner.reuse.exposed_ms)
                    intervals.append(planner.reuse.interval)
            if intervals:
                out.append({"concurrency": n, "measure": measure, "num_steps": len(intervals),
                            "exposed_ms": statistics.median(exposed),
                            "interval": statistics.median(intervals),
                            "mean_interval": statistics.fmean(intervals)})  # fmt: skip
    return out


def interval_table(rows: list[dict]) -> str:
    header = ["N", "decide_cost", "steps", "exposed ms a decide (median)", "interval (median)", "mean"]
    return table(header, [[str(r["concurrency"]), r["measure"], str(r["num_steps"]), fmt(r["exposed_ms"], 3),
                           fmt(r["interval"], 1), fmt(r["mean_interval"], 1)] for r in rows])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--budget", type=float, default=0.02, help="scheduler.decide_budget")
    ap.add_argument("--max-age", type=int, default=16, help="scheduler.max_plan_age")
    args = ap.parse_args(argv)
    rows = interval_rows(args.log, args.concurrency, args.budget, args.max_age)
    if not rows:
        raise SystemExit(f"{args.log}: no decode steps with host_ms at N = {args.concurrency}")
    print(interval_table(rows))


if __name__ == "__main__":
    main()
