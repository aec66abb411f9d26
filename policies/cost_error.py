"""How well the cost models predict step times: online (a running error the policy reads) and held
out (fit on the first part of a run's steps, score the rest; the regret benchmark's table).

Terms: the *relative error* of one step is |predicted − measured| / measured ms; *prequential*
(Dawid 1984, "Present position and potential developments: some personal views. Statistical theory:
the prequential approach", JRSS A 147) means each step is predicted by the models fitted on the
steps before it only, then learnt from — an honest online estimate of the error on unseen steps.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from specsched.engine.records import StepRecord
from specsched.policies.cost_model import CostModels
from specsched.policies.running_error import RunningError
from specsched.policies.shapes import StepShape

__all__ = [
    "HeldOutError",
    "RunningError",
    "held_out_error",
    "is_scored_step",
    "prequential_error",
    "score_error",
]


def is_scored_step(rec: StepRecord) -> bool:
    """A decode step the error tables score: scored by a named scorer, one forward (a run of plain
    steps, ``scheduler.decode_steps``, has its own ratio and is not learnt as one step)."""
    return rec.kind == "decode" and bool(rec.requests) and bool(rec.scorer) and rec.num_decode_steps == 1


@dataclass
class HeldOutError:
    """The held-out score-ms error of one (scorer, batch size)."""

    scorer: str
    batch_size: int
    num_fit: int  # steps of this group the models were fitted on (with every other group's)
    num_held_out: int
    median: float  # median |predicted − measured| / measured score ms over the held-out steps
    p90: float


def held_out_error(
    records: Iterable[StepRecord],
    fit_fraction: float = 0.5,
    device: str = "cpu",
    graph_buckets: dict[str, list[int]] | None = None,
) -> list[HeldOutError]:
    """Median relative error of the cost models' predicted score ms on held-out decode steps, per
    scorer and batch size.

    The decode records of one step each (a run of plain steps, ``scheduler.decode_steps``, has its
    own ratio, not the step models) are grouped by (scorer, batch size) in their order; the first
    ``fit_fraction`` of each group is the fit set, the rest held out (so every group is both fitted
    and scored, whichever configurations ran when). The models (device seeds, no forgetting: the
    run taken as stationary) learn the fit set in its original order, then predict each held-out
    step's score ms from its shape without learning from it.
    """
    if not 0.0 < fit_fraction < 1.0:
        raise ValueError(f"fit_fraction must be in (0, 1), got {fit_fraction}")
    groups: dict[tuple[str, int], list[tuple[int, StepRecord]]] = defaultdict(list)
    for i, rec in enumerate(records):
        if is_scored_step(rec):
            groups[(rec.scorer, rec.batch_size)].append((i, rec))
    fit, held = [], {}
    for key, recs in groups.items():
        cut = min(max(int(round(len(recs) * fit_fraction)), 1), len(recs) - 1) if len(recs) > 1 else 1
        fit += recs[:cut]
        held[key] = (cut, [r for _, r in recs[cut:]])
    costs = CostModels(graph_buckets, device=device, forgetting=1.0)
    for _, rec in sorted(fit, key=lambda x: x[0]):
        costs.observe(rec)
    out = []
    for (scorer, batch), (num_fit, recs) in sorted(held.items()):
        errors = [score_error(costs, r) for r in recs if r.score_ms > 0]
        if errors:
            out.append(HeldOutError(scorer, batch, num_fit, len(errors), float(np.median(errors)),
                                    float(np.percentile(errors, 90))))  # fmt: skip
    return out


def prequential_error(
    records: Iterable[StepRecord],
    device: str = "cpu",
    graph_buckets: dict[str, list[int]] | None = None,
    forgetting: float = 0.99,
    key=lambda rec: (rec.scorer, rec.batch_size),
) -> dict[tuple, float]:
    """Median relative error of each decode step's score ms predicted before the models learn it,
    per ``key`` (default: scorer and batch size): one pass in log order with the engine's forgetting,
    as the policy met its predictions live. Unlike :func:`held_out_error` (fit on the first part,
    models taken as stationary) it follows a drift of the machine, as the live models do, so the two
    differ by how much the machine drifted. Runs of plain steps are skipped, as the models skip them."""
    costs = CostModels(graph_buckets, device=device, forgetting=forgetting)
    errors: dict[tuple, list[float]] = defaultdict(list)
    for rec in records:
        if not is_scored_step(rec):
            continue
        if rec.score_ms > 0:
            errors[key(rec)].append(score_error(costs, rec))
        costs.observe(rec)
    return {k: float(np.median(v)) for k, v in errors.items()}


def score_error(costs, rec: StepRecord) -> float:
    """|predicted - measured| / measured score ms of ``rec`` under ``costs`` as they are now."""
    shape = StepShape([r.k for r in rec.requests], [r.context_len + 1 for r in rec.requests])
    predicted = costs.predict(rec.scorer, rec.proposer or "none", shape).score_ms
    return abs(predicted - rec.score_ms) / rec.score_ms


def error_table(rows: Sequence[HeldOutError]) -> list[dict]:
    """The rows as dicts (results.json, the markdown table)."""
    return [vars(r) for r in rows]
