"""What a decide costs a ``bench=serve`` daemon's steps, by where each step's plan came from.

The engine runs a decode step on one of four kinds of plan (engine/planning.py): one *carried* from
an earlier step, one *decided ahead* during the last step's scoring (``plan_info.is_planned_ahead``),
one *decided on the step* (its critical path), or — for the step before a plan decided ahead — the
one it carried while its scoring window held that decide (*deciding*). A decide ahead is not free
when it fills the device wait in which the daemon's IO and log threads work: their work moves to the
next step's releases of the interpreter lock (H100, 2026-12-06 17:29, goodput at N = 4: deciding
steps +0.08 ms after the launch, the steps after them +0.18 ms in the loop, first event record and
scoring launch, against carried steps). Per concurrency N this table gives each kind's share of the
decode steps of batch size N, its median step ms, its median ``SPILL_PHASES`` ms (between + first
event + score) and its median post-launch ms (overlap + verify), and the decide's estimated cost:
the deciding steps' post-launch excess plus the decided-ahead steps' spill excess, both over carried
steps' medians.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from specsched.bench.markdown import fmt, table
from specsched.bench.serve_host import last_run_with_host_ms
from specsched.engine.planning import SPILL_PHASES

__all__ = ["KINDS", "decide_cost_ms", "plan_kind", "plan_rows", "plan_table"]

KINDS = ("carried", "deciding", "ahead", "on step")
POST_PHASES = ("overlap", "verify")


def plan_kind(info: dict, is_next_ahead: bool) -> str:
    """The kind of a decode step's plan (module docstring) from its ``plan_info`` and whether the next
    decode step ran a plan decided ahead (its scoring window held that decide)."""
    if info.get("is_planned_ahead"):
        return "ahead"
    if info.get("plan_age", 0) == 0:
        return "on step"
    return "deciding" if is_next_ahead else "carried"


def plan_rows(log_path: str | Path, config: str, concurrency: list[int]) -> list[dict]:
    """Per N and plan kind, over the log's last run's decode steps of batch size N: the number of
    steps, their share, and the medians of step ms, spill ms and post-launch ms."""
    found = last_run_with_host_ms(log_path)
    if found is None:
        return []
    db, run = found
    steps = list(db.execute(
        "select step, batch_size, total_ms, host_ms, plan_info from steps where run_id = ? "
        "and kind = 'decode' and host_ms is not null order by step", [run],
    ))  # fmt: skip
    infos = [json.loads(s[4]) if s[4] else {} for s in steps]
    by = defaultdict(list)  # (N, kind) -> [(step ms, spill ms, post ms)]
    for i, (num, batch, total, host, _) in enumerate(steps):
        if batch not in concurrency:
            continue
        nxt = i + 1 < len(steps) and steps[i + 1][0] == num + 1 and infos[i + 1].get("is_planned_ahead")
        h = json.loads(host)
        by[(batch, plan_kind(infos[i], bool(nxt)))].append(
            (total or 0.0, sum(h.get(p, 0.0) for p in SPILL_PHASES), sum(h.get(p, 0.0) for p in POST_PHASES))
        )
    out = []
    for n in concurrency:
        num_n = sum(len(by[(n, k)]) for k in KINDS)
        for kind in KINDS:
            got = by[(n, kind)]
            if not got:
                continue
            out.append({"config": config, "concurrency": n, "kind": kind, "num_steps": len(got),
                        "share": len(got) / num_n, "step_ms": statistics.median(g[0] for g in got),
                        "spill_ms": statistics.median(g[1] for g in got),
                        "post_ms": statistics.median(g[2] for g in got)})  # fmt: skip
    return out


def decide_cost_ms(rows: list[dict]) -> float | None:
    """A decide ahead's estimated cost from one (config, N)'s rows: the deciding steps' post-launch ms
    and the decided-ahead steps' spill ms beyond the carried steps' (None without those three)."""
    at = {r["kind"]: r for r in rows}
    if not {"carried", "deciding", "ahead"} <= at.keys():
        return None
    carried = at["carried"]
    return (at["deciding"]["post_ms"] - carried["post_ms"]) + (at["ahead"]["spill_ms"] - carried["spill_ms"])


def plan_table(rows: list[dict]) -> str:
    """A row per (config, N): each kind's share and step / spill / post ms, and the decide's cost;
    "" when no config decided ahead (nothing to show)."""
    if not any(r["kind"] == "ahead" for r in rows):
        return ""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["config"], r["concurrency"])].append(r)
    header = ["config", "N", *(f"{k}: share, step / spill / post ms" for k in KINDS), "decide ahead costs ms"]
    out = []
    for (config, n), group in groups.items():
        at = {r["kind"]: r for r in group}
        cells = [_cell(at.get(k)) for k in KINDS]
        out.append([config, str(n), *cells, fmt(decide_cost_ms(group), 3)])
    return table(header, out)


def _cell(r: dict | None) -> str:
    if r is None:
        return "–"
    times = " / ".join(fmt(r[f], 3) for f in ("step_ms", "spill_ms", "post_ms"))
    return f"{100 * r['share']:.0f} %, {times}"
