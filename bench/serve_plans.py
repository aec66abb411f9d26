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
steps' medians; beside it the decides' own medians, wall ms and the engine thread's CPU ms
(``plan_info.decide_ms`` / ``decide_cpu_ms``, engine/planning.py ``timed_decide``): wall beyond CPU is
time the thread waited, for the interpreter lock or for a core.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from specsched.bench.markdown import fmt, table
from specsched.bench.serve_host import last_run_with_host_ms
from specsched.engine.planning import SPILL_PHASES

__all__ = ["KINDS", "DecodeStep", "decide_cost_ms", "decode_steps", "plan_kind", "plan_rows", "plan_table"]

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


@dataclass
class DecodeStep:
    """One decode step of a log, as the plan tables read it."""

    batch_size: int
    total_ms: float
    score_ms: float
    host_ms: dict[str, float]
    plan_info: dict
    next_info: dict  # the next step's plan_info when it is the next decode step by number, else {}

    @property
    def is_next_ahead(self) -> bool:
        """The next step ran a plan decided ahead: this step's scoring window held that decide."""
        return bool(self.next_info.get("is_planned_ahead"))


def decode_steps(log_path: str | Path) -> list[DecodeStep]:
    """The decode steps with host times of the log's last run, in order ([] for no such log)."""
    found = last_run_with_host_ms(log_path)
    if found is None:
        return []
    db, run = found
    rows = list(db.execute(
        "select step, batch_size, total_ms, score_ms, host_ms, plan_info from steps where run_id = ? "
        "and kind = 'decode' and host_ms is not null order by step", [run],
    ))  # fmt: skip
    infos = [json.loads(r[5]) if r[5] else {} for r in rows]
    return [
        DecodeStep(batch, total or 0.0, score or 0.0, json.loads(host), infos[i],
                   infos[i + 1] if i + 1 < len(rows) and rows[i + 1][0] == num + 1 else {})
        for i, (num, batch, total, score, host, _) in enumerate(rows)
    ]  # fmt: skip


def plan_rows(log_path: str | Path, config: str, concurrency: list[int]) -> list[dict]:
    """Per N and plan kind, over the log's last run's decode steps of batch size N: the number of
    steps, their share, and the medians of step ms, spill ms and post-launch ms; and on every row of
    an N its decides' median wall and CPU ms (``decide_ms``, ``decide_cpu_ms``: None where the log has
    none) and their number (the steps whose plan_info times a decide)."""
    by = defaultdict(list)  # (N, kind) -> [(step ms, spill ms, post ms)]
    decides = defaultdict(list)  # N -> [(wall ms, CPU ms or None)] of the steps that ran a decide
    for s in decode_steps(log_path):
        if s.batch_size not in concurrency:
            continue
        wall = s.plan_info.get("decide_ms") or 0.0
        if wall > 0:
            decides[s.batch_size].append((wall, s.plan_info.get("decide_cpu_ms")))
        h = s.host_ms
        by[(s.batch_size, plan_kind(s.plan_info, s.is_next_ahead))].append(
            (s.total_ms, sum(h.get(p, 0.0) for p in SPILL_PHASES), sum(h.get(p, 0.0) for p in POST_PHASES))
        )
    out = []
    for n in concurrency:
        num_n = sum(len(by[(n, k)]) for k in KINDS)
        walls = [w for w, _ in decides[n]]
        cpus = [c for _, c in decides[n] if c is not None]
        timing = {"num_decides": len(walls), "decide_ms": statistics.median(walls) if walls else None,
                  "decide_cpu_ms": statistics.median(cpus) if cpus else None}  # fmt: skip
        for kind in KINDS:
            got = by[(n, kind)]
            if not got:
                continue
            out.append({"config": config, "concurrency": n, "kind": kind, "num_steps": len(got),
                        "share": len(got) / num_n, "step_ms": statistics.median(g[0] for g in got),
                        "spill_ms": statistics.median(g[1] for g in got),
                        "post_ms": statistics.median(g[2] for g in got), **timing})  # fmt: skip
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
    header = ["config", "N", *(f"{k}: share, step / spill / post ms" for k in KINDS), "decide ahead costs ms",
              "a decide: wall / CPU ms (median, decides)"]  # fmt: skip
    out = []
    for (config, n), group in groups.items():
        at = {r["kind"]: r for r in group}
        cells = [_cell(at.get(k)) for k in KINDS]
        first = group[0]
        timing = "–"
        if first.get("num_decides"):
            timing = (
                f"{fmt(first['decide_ms'], 3)} / {fmt(first['decide_cpu_ms'], 3)} ({first['num_decides']})"
            )
        out.append([config, str(n), *cells, fmt(decide_cost_ms(group), 3), timing])
    return table(header, out)


def _cell(r: dict | None) -> str:
    if r is None:
        return "–"
    times = " / ".join(fmt(r[f], 3) for f in ("step_ms", "spill_ms", "post_ms"))
    return f"{100 * r['share']:.0f} %, {times}"
