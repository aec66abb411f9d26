"""Host time per step phase of ``bench=serve``'s daemons, read from their decision logs (issue 17:
the host side of a step <= 0.2 ms at batch 1 and <= 0.6 ms at batch 64).

For each config and concurrency N: the decode steps of batch size N (both passes), and per phase the
median of ``steps.host_ms`` (schema 3; engine/step_timer.py), with the step's median wall ms and its
GPU-idle ms = between + wall - (propose + score + verify) device ms: the host time the GPU waits for,
``between`` being the daemon's loop between two steps (outputs streamed, stats, commands; on CUDA
the phase columns of ``steps`` are CUDA-event times; the host phases ``score``/``overlap`` run while
the GPU works, ``verify`` includes the wait for it).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from specsched.bench.markdown import fmt, table
from specsched.engine.log_schema import LogFormatError, open_log

if TYPE_CHECKING:
    from sqlite_utils import Database

PHASES = ("between", "schedule", "view", "decide", "reserve", "propose", "score", "overlap", "verify",
          "commit", "record", "observe", "stats", "first_event", "events", "other")  # fmt: skip
HOST_GOAL_MS = {1: 0.2, 64: 0.6}  # issue 17: the GPU-idle host time per step at these batch sizes


def last_run_with_host_ms(log_path: str | Path) -> tuple[Database, int] | None:
    """The log and its last run's id, or None when it is no decision log or predates ``steps.host_ms``
    (schema 3)."""
    try:
        db = open_log(log_path)
    except LogFormatError:
        return None
    if "host_ms" not in db["steps"].columns_dict:
        return None
    return db, db.execute("select max(id) from runs").fetchone()[0]


def host_phase_rows(log_path: str | Path, config: str, concurrency: list[int]) -> list[dict]:
    """One row per N with decode steps of batch size N in the log's last run: medians in ms."""
    found = last_run_with_host_ms(log_path)
    if found is None:
        return []
    db, run = found
    out = []
    for n in concurrency:
        steps = list(db.query(
            "select host_ms, total_ms, propose_ms, score_ms, verify_ms, plan_info from steps "
            "where run_id = ? and kind = 'decode' and batch_size = ? and host_ms is not null", [run, n],
        ))  # fmt: skip
        if not steps:
            continue
        host = [json.loads(s["host_ms"]) for s in steps]
        walls = [s["total_ms"] for s in steps]
        median = statistics.median(walls)
        slow = sum(w > 2 * median for w in walls) / len(walls)  # the tail a median hides (stalls)
        idle = [s["total_ms"] + h.get("between", 0.0) - (s["propose_ms"] or 0) - (s["score_ms"] or 0)
                - (s["verify_ms"] or 0) for s, h in zip(steps, host)]  # fmt: skip
        # a run of plain steps (scheduler.decode_steps / plain_decode_steps) is one row for S forwards
        forwards = [json.loads(s["plan_info"]).get("decode_steps", 1) if s["plan_info"] else 1 for s in steps]
        row = {"config": config, "concurrency": n, "num_steps": len(steps), "total_ms": median,
               "mean_ms": statistics.fmean(walls), "slow_share": slow, "gpu_idle_ms": statistics.median(idle),
               "gpu_idle_per_forward_ms": sum(idle) / sum(forwards)}  # fmt: skip
        for p in PHASES:
            row[p] = statistics.median(h.get(p, 0.0) for h in host)
        out.append(row)
    return out


def host_table(rows: list[dict]) -> str:
    header = ["config", "N", "steps", "step ms", "mean", "> 2x", "GPU-idle ms (goal)",
              "GPU-idle ms a forward (mean)", *PHASES]  # fmt: skip
    out = []
    for r in rows:
        goal = HOST_GOAL_MS.get(r["concurrency"])
        idle = fmt(r["gpu_idle_ms"], 3) + (f" (≤ {goal})" if goal else "")
        out.append([r["config"], str(r["concurrency"]), str(r["num_steps"]), fmt(r["total_ms"], 3),
                    fmt(r.get("mean_ms"), 3), _pct(r.get("slow_share")), idle,
                    fmt(r.get("gpu_idle_per_forward_ms"), 3), *(fmt(r[p], 3) for p in PHASES)])  # fmt: skip
    return table(header, out)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def host_note() -> str:
    return (
        "Host ms per decode step by phase (medians over the steps of batch size N, both passes; "
        "`steps.host_ms` of the decision logs; step ms: the median, its mean, and the share of steps "
        "over twice the median): between = the daemon's loop since the last step "
        "(streaming the outputs, stats, commands); view = proposer peek + acceptance estimates; decide = "
        "the critical path's (≈0 when decided ahead); score = input build + launch; overlap = cost-model "
        "update + next step's decide while the GPU scores and verifies; verify = the verification's "
        "launch (queued behind the forward) and, after the overlap, its read (the wait for the GPU); "
        "first_event = the step's first CUDA event record (its first release of the interpreter lock, "
        "where the daemon's other threads do the work the last step gave them); events = the other "
        "event records around the timed phases (3-5 calls into torch). "
        "GPU-idle = between + step wall − (propose + score + verify) device ms; a forward's: the steps' "
        "GPU-idle summed over their forwards (a run of S plain steps is one step of S forwards)."
    )


def step_mix_row(log_path: str | Path, config: str) -> dict | None:
    """Where a daemon's time went (its log's last run, every pass and N): decode and prefill steps,
    their wall ms (the step's own plus the loop's ``between`` before it), the share in prefill, the
    mean prefill step, and the share of decode steps that ran a fresh decide (``plan_info.plan_age``
    0 or absent; a carried plan has plan_age > 0: engine/planning.py)."""
    try:
        db = open_log(log_path)
    except LogFormatError:
        return None
    run = db.execute("select max(id) from runs").fetchone()[0]
    rows = list(db.query("select kind, total_ms, score_ms, host_ms, plan_info from steps where run_id = ?",
                         [run]))  # fmt: skip
    if not rows:
        return None
    wall = {"decode": 0.0, "prefill": 0.0}
    count = {"decode": 0, "prefill": 0}
    prefill_score, decided = [], 0
    for r in rows:
        kind = r["kind"]
        if kind not in wall:
            continue
        between = json.loads(r["host_ms"]).get("between", 0.0) if r["host_ms"] else 0.0
        wall[kind] += (r["total_ms"] or 0.0) + between
        count[kind] += 1
        if kind == "prefill":
            prefill_score.append(r["score_ms"] or 0.0)
        elif not (json.loads(r["plan_info"]) if r["plan_info"] else {}).get("plan_age"):
            decided += 1
    total = wall["decode"] + wall["prefill"]
    return {
        "config": config, "num_decode_steps": count["decode"], "num_prefill_steps": count["prefill"],
        "decode_s": wall["decode"] / 1e3, "prefill_s": wall["prefill"] / 1e3,
        "prefill_share": wall["prefill"] / total if total else None,
        "prefill_score_ms": statistics.fmean(prefill_score) if prefill_score else None,
        "decides_per_step": decided / count["decode"] if count["decode"] else None,
    }  # fmt: skip


def step_mix_table(rows: list[dict]) -> str:
    header = ["config", "decode steps", "prefill steps", "decode s", "prefill s", "share in prefill",
              "prefill score ms (mean)", "decides / decode step"]  # fmt: skip
    out = [[r["config"], str(r["num_decode_steps"]), str(r["num_prefill_steps"]), fmt(r["decode_s"], 2),
            fmt(r["prefill_s"], 2), fmt(r["prefill_share"]), fmt(r["prefill_score_ms"], 3),
            fmt(r["decides_per_step"])] for r in rows]  # fmt: skip
    return table(header, out)


def host_counters(stats) -> dict | None:
    """A daemon's ``stats`` ``host`` map (daemon/host_stats.py: the engine thread's context switches and
    last CPU, the process's transparent huge pages and threads) as a plain dict; None without one."""
    host = getattr(stats, "host", None)
    return None if host is None else dataclasses.asdict(host)


def daemon_host_rows(configs: list[dict]) -> list[list[str]]:
    """One row per daemon (each config's, then its replicas') that reported host counters at the end
    of its rounds: a daemon slower than another of the same run on the same code path may show why."""
    out = []
    for c in configs:
        for info in [c, *(c.get("replicas") or [])]:
            h = info.get("host")
            if not h:
                continue
            huge = h.get("anon_huge_pages_bytes")
            huge_mib = "–" if huge is None else fmt(huge / 2**20, 1)
            out.append([info.get("name", c["name"]), fmt(h.get("engine_nonvoluntary_switches"), 0),
                        fmt(h.get("engine_voluntary_switches"), 0), fmt(h.get("engine_last_cpu"), 0),
                        huge_mib, fmt(h.get("num_threads"), 0)])  # fmt: skip
    return out


def daemon_host_table(configs: list[dict]) -> str:
    rows = daemon_host_rows(configs)
    if not rows:
        return ""
    header = ["daemon", "engine thread: CPU taken away (nonvoluntary switches)", "its own waits (voluntary)",
              "its last CPU", "transparent huge pages MiB", "threads"]  # fmt: skip
    return table(header, rows)
