"""The cost models' held-out step-time error per scorer and batch-size group, on decision logs (issue 13:
median <= 5% per scorer and batch size).

:func:`specsched.policies.cost_error.held_out_error` groups a run's decode steps by (scorer, batch
size), fits fresh models (device seeds, no forgetting, the run's graph buckets as saved with its
cost models) on the first half of each group in log order,
and scores the score-ms prediction of the rest. Here the batch size a step is grouped by is its
group's upper bound (1, 2-4, 5-16, 17-64, 65+), so that the groups of a serving log (batches that
drift as requests join and leave) hold enough steps; the prediction still uses each step's own
shape. The same split also scores the *total* step ms (propose + score + verify + overhead), which is
what the replay charges a step, and gives a *noise floor*: each held-out step's score ms predicted by
the median score ms of the fit steps of exactly its shape (batch size and token count), where there
are any: what no model of the shape could beat, the step-to-step jitter of the machine. The last
column scores each step's score ms predicted before the models learn it, in one pass with the
engine's forgetting (:func:`specsched.policies.cost_error.prequential_error`): the error the policy
met live, which follows a drift of the machine that the fit-then-hold-out split does not.

``python -m specsched.bench.cost_error_table a.sqlite [b.sqlite ...] [--all-runs]``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from specsched.bench.markdown import fmt, table
from specsched.engine.log_schema import LogFormatError, open_log
from specsched.engine.records import StepRecord
from specsched.policies.cost_error import held_out_error, is_scored_step, prequential_error
from specsched.policies.cost_model import CostModels
from specsched.policies.replay_log import RecordedRun, ReplayError, load_run
from specsched.policies.shapes import StepShape

GROUPS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 1 << 30))


def group_of(batch_size: int) -> tuple[int, int]:
    return next(g for g in GROUPS if g[0] <= batch_size <= g[1])


def group_label(g: tuple[int, int]) -> str:
    return str(g[0]) if g[0] == g[1] else f"{g[0]}+" if g[1] >= 1 << 30 else f"{g[0]}-{g[1]}"


def grouped(records: Sequence[StepRecord]) -> list[StepRecord]:
    """The decode records with ``batch_size`` set to the upper bound of its group (the key only)."""
    return [dataclasses.replace(r, batch_size=group_of(r.batch_size)[1]) for r in records
            if is_scored_step(r)]  # fmt: skip


def split(records: Sequence[StepRecord], fit_fraction: float = 0.5):
    """:func:`held_out_error`'s split: per (scorer, batch size), the first ``fit_fraction`` fits.
    Returns the fit (log index, record) pairs and the held-out records per key."""
    groups: dict[tuple[str, int], list[tuple[int, StepRecord]]] = defaultdict(list)
    for i, rec in enumerate(records):
        groups[(rec.scorer, rec.batch_size)].append((i, rec))
    fit, held = [], {}
    for key, recs in groups.items():
        cut = min(max(round(len(recs) * fit_fraction), 1), len(recs) - 1) if len(recs) > 1 else 1
        fit += recs[:cut]
        held[key] = [r for _, r in recs[cut:]]
    return fit, held


def noise_floor(records: Sequence[StepRecord], fit_fraction: float = 0.5) -> dict:
    """(scorer, group upper bound) -> median relative error of predicting a held-out step's score ms
    by the median of the fit steps of its exact shape (held-out steps without one are left out)."""
    fit, held = split(records, fit_fraction)
    by_shape: dict[tuple, list[float]] = defaultdict(list)
    for _, r in fit:
        by_shape[(r.scorer, len(r.requests), r.num_tokens)].append(r.score_ms)
    out = {}
    for key, recs in held.items():
        shaped = [(r, (r.scorer, len(r.requests), r.num_tokens)) for r in recs if r.score_ms > 0]
        errs = [
            abs(float(np.median(by_shape[s])) - r.score_ms) / r.score_ms for r, s in shaped if s in by_shape
        ]
        if errs:
            out[key] = float(np.median(errs))
    return out


def total_error(
    records: Sequence[StepRecord],
    device: str,
    fit_fraction: float = 0.5,
    graph_buckets: dict[str, list[int]] | None = None,
) -> dict:
    """(scorer, group upper bound) -> median |pred - meas| / meas of the total step ms, with the
    split of :func:`held_out_error` (the first ``fit_fraction`` of each group fits) and the run's
    ``graph_buckets`` (padding and per-graph residuals, as the engine's models had them)."""
    fit, held = split(records, fit_fraction)
    costs = CostModels(graph_buckets, device=device, forgetting=1.0)
    for _, rec in sorted(fit, key=lambda x: x[0]):
        costs.observe(rec)
    out = {}
    for key, recs in held.items():
        errs = [abs(_total(costs, r) - r.cost_ms) / r.cost_ms for r in recs if r.total_ms > 0]
        if errs:
            out[key] = float(np.median(errs))
    return out


def _total(costs: CostModels, rec: StepRecord) -> float:
    shape = StepShape([q.k for q in rec.requests], [q.context_len + 1 for q in rec.requests])
    return costs.predict(rec.scorer, rec.proposer or "none", shape).total_ms


def cost_error_rows(logs: Sequence[tuple[str, RecordedRun]]) -> list[list[str]]:
    """One row per log, scorer and batch group: steps fitted / held out, score-ms median and p90
    error, the noise floor, total-ms median error, the score-ms error predicted before learnt
    (percent)."""
    rows = []
    for name, run in logs:
        device = "cuda" if run.device.startswith("cuda") else "cpu"
        recs, buckets = grouped(run.decode_steps), run.settings.graph_buckets or None
        # the graphs the run captured (saved with its cost models): each scorer's padding and
        # per-graph residual, as the engine predicted (a log without them: every scorer unpadded)
        totals, floor = total_error(recs, device, graph_buckets=buckets), noise_floor(recs)
        online = prequential_error(recs, device, buckets)
        for e in held_out_error(recs, device=device, graph_buckets=buckets):
            key = (e.scorer, e.batch_size)
            pct = [fmt(100 * d[key], 1) if key in d else "–" for d in (floor, totals, online)]
            rows.append([name, e.scorer, group_label(group_of(e.batch_size)), str(e.num_fit),
                         str(e.num_held_out), fmt(100 * e.median, 1), fmt(100 * e.p90, 1), *pct])  # fmt: skip
    return rows


HEADER = ["log", "scorer", "batch", "fit steps", "held-out steps", "score ms median err %", "score p90 %",
          "noise floor %", "total ms median err %", "score ms, predicted before learnt (live) %"]  # fmt: skip


def cost_error_markdown(logs: Sequence[tuple[str, RecordedRun]]) -> str:
    return table(HEADER, cost_error_rows(logs))


def read_log(path: str, all_runs: bool = False) -> RecordedRun:
    """The log's last run, or (``all_runs``) its runs' steps one after another, in run order (runs of
    plain steps are read and left out of the table: they are not one step)."""
    if not all_runs:
        return load_run(path)
    db = open_log(path)
    try:
        ids = [r[0] for r in db.execute("select id from runs order by id")]
    finally:
        db.close()
    runs = [load_run(path, i) for i in ids]
    if not runs:
        raise LogFormatError(f"{path}: the log holds no runs")
    return dataclasses.replace(runs[-1], steps=[s for r in runs for s in r.steps])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="decision logs (SQLite)")
    ap.add_argument("--all-runs", action="store_true",
                    help="every run of each log in one table (regret logs: a run per window)")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        runs = [(p.rsplit("/", 1)[-1].removesuffix(".sqlite"), read_log(p, args.all_runs)) for p in args.logs]
    except (LogFormatError, ReplayError) as e:
        sys.stderr.write(f"cost_error_table: {e}\n")
        return 2
    sys.stdout.write(cost_error_markdown(runs) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
