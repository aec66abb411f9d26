"""The host's speed loop by loop in a rounds run of ``bench=serve`` (``bench.serve.rounds``), read from
the daemons' decision logs: is a config's slow round its own doing, or did every daemon slow down then?

On an H100 on 2026-12-07 (19:12, ``bench=serve_h200_verdict``) goodput lost 10.9 % to k = 8 at N = 4,
yet on one daemon's costs the two were 0.3 % apart. Laid out in time, the daemons' loops showed a
stretch of ~8 s where every daemon's host phases (the daemon loop's ``between``, the first CUDA event
record, the score phase's input build and launch, the commit) ran 10-25 % slower than in the same
config's other loops at that N (host index 1.08-1.23), non-speculative and k = 8 included; two of
goodput's four rounds at N = 4 fell into it. A config's per-round loss is its policy's doing only
where its loop's host ms were near its rival's in the same round (the report's per-round table,
bench/serve_report.py ``paired_table``, from :func:`round_host_ms`).

A loop is a run of one daemon's decode steps with no gap over ``GAP_S`` (the daemons not under load
take no steps); its N is the largest batch size among them (N clients never have more requests
running), its phase times the medians of ``steps.host_ms`` over its steps of at least ``STEADY`` x N
requests (the closed loop's steady state: a client between two requests leaves the batch a step or
two). Its **host index** is the median, over
``PHASES``, of its phase median divided by the median of that phase over all loops of its config at
that N (its replicas' too: ``<config>_replica_<k>`` logs): 1.0 = the config's usual host speed at that
N, 1.4 = its host work took 40 % longer there; a replica slower for its whole life shows as an offset.

    python -m specsched.bench.serve_drift LOG.sqlite [LOG.sqlite ...] [--out drift.md]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from specsched.bench.markdown import emit, fmt, log_name, table
from specsched.bench.serve_host import last_run_with_host_ms

__all__ = ["GAP_S", "PHASES", "Loop", "config_of", "log_loops", "with_indices", "drift_table", "drift_note",
           "round_host_ms", "rounds_table"]  # fmt: skip

GAP_S = 0.5  # one daemon's decode steps further apart than this belong to different loops
STEADY = 0.75  # a loop's phase medians are over its steps of at least this share of its N requests
# host phases every config's step has, whatever it decides (its view and decide differ by policy)
PHASES = ("between", "schedule", "score", "commit", "first_event", "events")
SHOWN = ("between", "first_event", "score", "commit")  # the table's phase columns


@dataclass
class Loop:
    daemon: str  # the log's name
    start: float  # time.time() of its first decode step
    n: int  # its largest batch size: the concurrency it ran at
    num_steps: int  # its decode steps of at least STEADY x n requests
    phase_ms: dict[str, float] = field(default_factory=dict)  # median host ms per phase over them
    index: float | None = None  # host index (module docstring); None: no phase to compare


def config_of(daemon: str) -> str:
    """The config a daemon's log belongs to: its name less a ``_replica_<k>`` suffix."""
    return re.sub(r"_replica_\d+$", "", daemon)


def _segments(rows: list[tuple[float, int, str]], gap_s: float) -> list[list[tuple[float, int, dict]]]:
    """``rows`` (start_time, batch_size, host_ms JSON) in step order, cut where two steps are more
    than ``gap_s`` apart."""
    out: list[list[tuple[float, int, dict]]] = []
    last = None
    for t, b, h in rows:
        if last is None or t - last > gap_s:
            out.append([])
        last = t
        out[-1].append((t, b, json.loads(h)))
    return out


def log_loops(log_path: str | Path, gap_s: float = GAP_S, min_steps: int = 5) -> list[Loop]:
    """The loops of a decision log's last run (module docstring), in time order; loops with fewer than
    ``min_steps`` steady steps are left out. [] for a log without ``steps.host_ms``."""
    found = last_run_with_host_ms(log_path)
    if found is None:
        return []
    db, run = found
    rows = db.execute(
        "select start_time, batch_size, host_ms from steps where run_id = ? and kind = 'decode' "
        "and host_ms is not null order by step", [run],
    ).fetchall()  # fmt: skip
    name, loops = log_name(str(log_path)), []
    for seg in _segments(rows, gap_s):
        n = max(b for _, b, _ in seg)  # N clients never run more than N requests at once
        floor = math.ceil(STEADY * n)
        steps = [h for _, b, h in seg if b >= floor]
        if len(steps) < min_steps:
            continue
        phases = {p: statistics.median(h.get(p, 0.0) for h in steps) for p in PHASES}
        loops.append(Loop(name, seg[0][0], n, len(steps), phases))
    return loops


def with_indices(loops: list[Loop]) -> list[Loop]:
    """Each loop's host index against the loops of its config (all replicas) at its N; returns ``loops``
    sorted by start time."""
    groups: dict[tuple[str, int], list[Loop]] = {}
    for lp in loops:
        groups.setdefault((config_of(lp.daemon), lp.n), []).append(lp)
    for group in groups.values():
        ref = {p: statistics.median(lp.phase_ms[p] for lp in group) for p in PHASES}
        for lp in group:
            ratios = [lp.phase_ms[p] / ref[p] for p in PHASES if ref[p] > 0]
            lp.index = statistics.median(ratios) if ratios else None
    return sorted(loops, key=lambda lp: lp.start)


def round_host_ms(loops: list[Loop], config: str, n: int, num_rounds: int) -> list[float] | None:
    """The host ms of ``config``'s loop in each of its ``num_rounds`` rounds at concurrency ``n``: the
    sum of the medians of the phases in ``SHOWN`` (the daemon loop, the first event record, the score
    phase's input build and launch, the commit), for the last ``num_rounds`` loops of the config's
    daemons (``config`` as its log is named, replicas included) at ``n`` in time order (the rounds run
    one after another; a warm-up before them is left out). None when its logs hold fewer loops."""
    mine = [lp for lp in loops if config_of(lp.daemon) == config and lp.n == n]
    mine.sort(key=lambda lp: lp.start)
    if len(mine) < num_rounds or num_rounds < 1:
        return None
    return [sum(lp.phase_ms[p] for p in SHOWN) for lp in mine[-num_rounds:]]


def drift_table(loops: list[Loop]) -> str:
    """Every loop in time order: seconds since the first, daemon, N, steps, host index, phase medians;
    then per N the spread of the indices. Empty without loops."""
    if not loops:
        return ""
    t0 = min(lp.start for lp in loops)
    rows = [[fmt(lp.start - t0, 1), lp.daemon, str(lp.n), str(lp.num_steps), fmt(lp.index),
             *[fmt(lp.phase_ms[p], 3) for p in SHOWN]] for lp in loops]  # fmt: skip
    text = table(["t s", "daemon (log)", "N", "steps", "host index", *[f"{p} ms" for p in SHOWN]], rows)
    lines = []
    for n in sorted({lp.n for lp in loops}):
        idx = [lp.index for lp in loops if lp.n == n and lp.index is not None]
        if idx:
            slow = sum(i >= 1.15 for i in idx)
            lines.append(f"N = {n}: host index {fmt(min(idx))}-{fmt(max(idx))}, {slow} of {len(idx)} loops "
                         "≥ 1.15")  # fmt: skip
    return text + ("\n\n" + "; ".join(lines) + "." if lines else "")


# a loop whose busiest load process used this much of a core is called load-bound (bench/client_load.py:
# past ~1 core a process's chunks queued for tens to hundreds of ms)
LOAD_BOUND_SHARE = 0.8


def rounds_table(rows: list[dict]) -> str:
    """Each round's loop of each (config, N), in the rounds' order: tok/s, host ms (``round_host_ms``),
    the engine thread's nonvoluntary context switches during the loop (``round_switches``: its CPU
    taken by another thread or process; a slow loop with few of them ran on a slower CPU, not a busy
    one) and the busiest load process's core share (``round_load_share``: near 1, the clients set the
    loop's pace, not the daemon; such loops are listed under the table). Empty without rows that have
    round tok/s."""
    out, seen, load_bound = [], set(), []
    for r in rows:
        key = (r["config"], r["concurrency"])
        tok = r.get("round_tok_s")
        if not tok or key in seen:
            continue
        seen.add(key)
        host = r.get("round_host_ms") or [None] * len(tok)
        sw = r.get("round_switches") or [None] * len(tok)
        load = r.get("round_load_share") or [None] * len(tok)
        cells = [f"{fmt(t, 0)} / {fmt(h, 3)} / {'–' if s is None else s} / {fmt(x)}"
                 for t, h, s, x in zip(tok, host, sw, load)]  # fmt: skip
        out.append([r["config"], str(r["concurrency"]), "; ".join(cells)])
        load_bound += [f"{r['config']} at N = {r['concurrency']}, round {i}"
                       for i, x in enumerate(load, 1) if x is not None and x >= LOAD_BOUND_SHARE]  # fmt: skip
    if not out:
        return ""
    out.sort(key=lambda row: (int(row[1]), row[0]))
    text = table(["config", "N", "each round: tok/s / host ms / engine CPU taken (switches) / load process "
                  "core share (busiest)"], out)  # fmt: skip
    if load_bound:
        text += (f"\n\nLoad-bound loops (a load process at ≥ {LOAD_BOUND_SHARE} of a core: its clients may "
                 f"have set the pace, not the daemon): {'; '.join(load_bound)}.")  # fmt: skip
    return text


def threads_table(rows: list[dict]) -> str:
    """Each round's loop of each (config, N): the daemon's engine, IO and log-writer threads' CPU seconds
    over the loop's wall seconds (``round_threads``, daemon/host_stats.py), their sum, the whole
    process's, and the engine thread's run-queue share (runnable without a CPU). On CUDA the engine
    thread spins while it waits for the device (its events synchronize without blocking), so its share
    is near 1 whatever its host work; the IO and log threads' shares are the interpreter lock they take
    from it. Empty without such rows."""
    out, seen = [], set()
    for r in rows:
        key = (r["config"], r["concurrency"])
        loops = r.get("round_threads")
        if not loops or key in seen or not any(loops):
            continue
        seen.add(key)
        cells = []
        for x in loops:
            x = x or {}
            py = [x.get(k) for k in ("engine", "io", "log")]
            total = sum(v for v in py if v is not None) if any(v is not None for v in py) else None
            cells.append(" / ".join(fmt(v) for v in (*py, total, x.get("process"), x.get("engine_runqueue"))))
        out.append([r["config"], str(r["concurrency"]), "; ".join(cells)])
    if not out:
        return ""
    out.sort(key=lambda row: (int(row[1]), row[0]))
    return table(["config", "N", "each round, share of its wall: engine / IO / log writer / the three / "
                  "whole process / engine waiting for a CPU"], out)  # fmt: skip


def drift_note() -> str:
    return (
        "The host's speed loop by loop (bench/serve_drift.py): each daemon's loops in time order, host "
        "index = the median over the phases between, schedule, score, commit, first_event and events of "
        "the loop's median host ms over its config's median at that N, replicas pooled (1.00 the config's "
        "usual speed; a stretch where every daemon's index rose is the host's drift, not a config's "
        "doing):"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path, help="the daemons' decision logs of one run")
    ap.add_argument("--gap-s", type=float, default=GAP_S, help="steps further apart: another loop")
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args(argv)
    loops = with_indices([lp for path in args.logs for lp in log_loops(path, args.gap_s)])
    if not loops:
        raise SystemExit("no decode steps with host_ms in these logs (schema 3 or later)")
    emit(drift_note() + "\n\n" + drift_table(loops) + "\n", args.out)


if __name__ == "__main__":
    main()
