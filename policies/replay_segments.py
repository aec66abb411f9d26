"""Replaying a closed-loop serving log by concurrency (the decision logs of ``bench=serve``).

A ``bench=serve`` daemon serves N clients at a time, N = 1, 4, 16, 64 one after another. The plain
replay (:mod:`specsched.policies.replay`) admits every request of the run up to ``max_num_seqs`` at
once: a serving log would replay as one batch-64 run. Here the run is cut into *segments*: a segment
starts at a decode step that shares no request with the decode step before it (the engine ran dry in
between: a loop ended, or at N = 1 one request followed the other). A segment's *level* is its
largest decode batch, rounded up to the nearest of ``levels``. The segments of one level are
replayed together with ``max_num_seqs`` = the level: all their requests queued, the replay keeps
that many running, as N clients in a closed loop do (the clients' gap between a reply and their next
request, ~0.1 ms, and the daemon's loop between steps are not modelled). Prefill steps go with the
segment they fall in, with their measured time, for every policy alike.

Measured against live rows (docs/benchmarks.md, 2026-12-04): the recorded steps' own time is
predicted within a few percent per level, but a fixed-k run replayed from the goodput log can miss
the live fixed-k run by ~10% at N = 4 and 16 (the live loop's ramp, drain and host time between steps).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from specsched.policies.registry import build_policy
from specsched.policies.replay import PolicyResult, ReplayOptions, policy_label, recorded_result, simulate
from specsched.policies.replay_bits import MatchBits, complete_bits
from specsched.policies.replay_costs import refit_costs
from specsched.policies.replay_log import RecordedRun

LEVELS = (1, 4, 16, 64)


@dataclass
class LevelReplay:
    level: int  # the concurrency its segments ran at (max_num_seqs of the replay)
    num_segments: int
    num_requests: int
    rows: list[PolicyResult]  # recorded, then each policy replayed


def level_of(batch: int, levels: Sequence[int] = LEVELS) -> int:
    """The smallest level >= ``batch`` (the largest level when none is)."""
    return next((n for n in sorted(levels) if batch <= n), max(levels))


def split_levels(run: RecordedRun, bits: MatchBits, levels: Sequence[int] = LEVELS) -> dict[int, tuple]:
    """level -> (the sub-run of its segments' steps and requests, their bits, number of segments)."""
    seg_steps: list[list] = []
    seg_batch: list[int] = []
    prev: set[str] = set()
    for s in run.steps:
        if s.kind == "decode" and s.requests:
            ids = {q.request_id for q in s.requests}
            if not ids & prev:
                seg_steps.append([])
                seg_batch.append(0)
            prev = ids
            seg_batch[-1] = max(seg_batch[-1], len(ids))
        if seg_steps:
            seg_steps[-1].append(s)
    first_seg: dict[str, int] = {}
    for i, steps in enumerate(seg_steps):
        for s in steps:
            for q in s.requests or []:
                first_seg.setdefault(q.request_id, i)
    by_level: dict[int, list[int]] = {}
    for i, b in enumerate(seg_batch):
        by_level.setdefault(level_of(b, levels), []).append(i)
    out = {}
    for level, segs in sorted(by_level.items()):
        mine = set(segs)
        idx = [i for i, r in enumerate(run.requests) if first_seg.get(r.key.split("#")[0]) in mine]
        sub = replace(
            run,
            steps=[s for i in segs for s in seg_steps[i]],
            requests=[run.requests[i] for i in idx],
            settings=replace(run.settings, max_num_seqs=level),
        )
        sub_bits = replace(bits, bits=[bits.bits[i] for i in idx], imputed=[bits.imputed[i] for i in idx])
        out[level] = (sub, sub_bits, len(segs))
    return out


def replay_by_level(
    run: RecordedRun,
    policies: Sequence[Mapping],
    options: ReplayOptions | None = None,
    levels: Sequence[int] = LEVELS,
    closed_loop: bool = True,
) -> list[LevelReplay]:
    """Per level: the recorded row and each policy replayed (one cost model refitted on the whole run;
    a fresh policy per level). ``closed_loop``: each client's requests one at a time, in its recorded
    order (:func:`~specsched.policies.replay.simulate`), so the replay ramps and drains as the loop
    did; else every request of the level queued at once. A policy that cannot run gets a row with
    its ``error``."""
    opts = options or ReplayOptions()
    bits = complete_bits(run, opts.seed)
    costs = refit_costs(run, opts.forgetting)
    out = []
    for level, (sub, sub_bits, num_segments) in split_levels(run, bits, levels).items():
        rows = [recorded_result(sub, costs)]
        for cfg in policies:
            label = policy_label(cfg)
            try:
                policy = build_policy(dict(cfg))
                rows.append(
                    simulate(sub, sub_bits, policy, costs, label, opts.scorers, closed_loop=closed_loop)
                )
            except ValueError as e:
                rows.append(PolicyResult(label, "replayed", error=str(e)))
        out.append(LevelReplay(level, num_segments, len(sub.requests), rows))
    return out


def format_levels(levels: list[LevelReplay]) -> str:
    """One line per (level, row): tok/s predicted (and measured for the recorded row)."""
    width = max([len(r.label) for lv in levels for r in lv.rows] + [6])
    head = f"{'N':<4}{'segments':>8}  {'requests':>8}  {'policy':<{width}}  source    "
    lines = [head + f"{'pred tok/s':>10}  {'meas tok/s':>10}  {'tok/step':>8}"]
    for lv in levels:
        for r in lv.rows:
            left = f"{lv.level:<4}{lv.num_segments:>8}  {lv.num_requests:>8}  {r.label:<{width}}  "
            if r.error:
                lines.append(left + r.error)
                continue
            meas = f"{r.measured_tokens_per_s:.1f}" if r.measured_tokens_per_s else "-"
            cells = f"{r.source:<9} {r.tokens_per_s:>10.1f}  {meas:>10}  {r.tokens_per_step:>8.2f}"
            lines.append(left + cells)
    return "\n".join(lines)
