"""A decision log's decode steps replayed in order through fresh cost models, as the policy met them
live, with the cost models' two guards on or off: the launch guard (policies/launch_guard.py: a step
whose scoring launch the host was slow to issue teaches nothing) and the winsorized per-graph residual
(policies/bucket_bias.py). Per log and variant: the prequential median score error per (scorer, batch
group) and, over the run, the mean predicted score gap at batch 1 between two drafts counts of one graph
scorer (k = 8 against k = 3 on the MQA graph by default: the same step on SmolLM2's H100, measured ~0.01
ms). How the guards were measured (docs/benchmarks.md, 2026-12-06, "Slow launches skipped").

    python -m specsched.bench.cost_replay LOG.sqlite [LOG ...] [--scorer mqa_graph] [--gap 8 3]
        [--context 300] [--variants before winsorized guard both]
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import specsched.policies.bucket_bias as bucket_bias
from specsched.policies.cost_error import is_scored_step, score_error
from specsched.policies.cost_model import CostModels
from specsched.policies.replay_log import load_run
from specsched.policies.shapes import StepShape

VARIANTS = {
    "before": (False, False),
    "winsorized": (True, False),
    "guard": (False, True),
    "both": (True, True),
}
GROUPS = ((1, "1"), (4, "2-4"), (16, "5-16"), (64, "17-64"))  # batch groups: (upper bound, label)


def batch_group(batch_size: int) -> str:
    return next((label for top, label in GROUPS if batch_size <= top), "65+")


@contextmanager
def residual_winsorized(is_on: bool) -> Iterator[None]:
    """The per-graph residual winsorized (the default) or, off, a plain exponential mean (as before
    2026-12-06: no step is clipped)."""
    saved = bucket_bias.MIN_CLIPPED
    bucket_bias.MIN_CLIPPED = saved if is_on else math.inf
    try:
        yield
    finally:
        bucket_bias.MIN_CLIPPED = saved


def replay_costs(
    path: str | Path, winsorized: bool = True, guard: bool = True, scorer: str = "mqa_graph",
    gap: tuple[int, int] = (8, 3), context: int = 300, every: int = 500,
) -> dict:  # fmt: skip
    """One variant on one log: ``errors`` {(scorer, batch group): median relative score error},
    ``gap_ms`` (the mean of the batch-1 predicted score of ``gap[0]`` drafts minus ``gap[1]``'s, read
    every ``every`` steps; None when the log's graph scorers do not include ``scorer``), the number of
    steps and of those the guard skipped."""
    run = load_run(str(path))
    records = [r for r in run.decode_steps if is_scored_step(r)]
    buckets = {name: list(b) for name, b in run.settings.graph_buckets.items()}
    errors: dict[tuple[str, str], list[float]] = {}
    gaps: list[float] = []
    with residual_winsorized(winsorized):
        costs = CostModels(buckets, device="cuda" if buckets else "cpu")
        if not guard:
            costs.launch_guard.ratio = math.inf
        for i, rec in enumerate(records):
            if rec.score_ms > 0:
                errors.setdefault((rec.scorer, batch_group(rec.batch_size)), []).append(
                    score_error(costs, rec)
                )
            costs.observe(rec)
            if scorer in buckets and i % every == every - 1:
                hi, lo = (costs.predict(scorer, "ngram", StepShape([k], [context])).score_ms for k in gap)
                gaps.append(hi - lo)
    return {
        "errors": {key: statistics.median(v) for key, v in errors.items()},
        "gap_ms": statistics.fmean(gaps) if gaps else None,
        "num_steps": len(records),
        "num_disturbed": costs.launch_guard.num_disturbed,
    }


def table(paths: Sequence[str], variants: Sequence[str], **kwargs) -> str:
    """The markdown table of every log x variant."""
    rows = {(p, v): replay_costs(p, *VARIANTS[v], **kwargs) for p in paths for v in variants}
    keys = sorted({key for r in rows.values() for key in r["errors"]})
    gap = kwargs.get("gap", (8, 3))
    head = [
        "log",
        "variant",
        f"k{gap[0]} − k{gap[1]} gap, mean (ms)",
        "skipped",
        *(f"{s} {g}" for s, g in keys),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (p, v), r in rows.items():
        gap_ms = "–" if r["gap_ms"] is None else f"{r['gap_ms']:.3f}"
        skipped = f"{r['num_disturbed']} / {r['num_steps']}"
        cells = [f"{Path(p).parent.name}/{Path(p).stem}", v, gap_ms, skipped]
        cells += [f"{100 * r['errors'][k]:.1f}" if k in r["errors"] else "–" for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="decision logs (SQLite)")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--scorer", default="mqa_graph", help="the graph scorer of the batch-1 price gap")
    ap.add_argument("--gap", type=int, nargs=2, default=[8, 3], metavar=("K_HI", "K_LO"))
    ap.add_argument("--context", type=int, default=300, help="context length of the gap's shapes")
    args = ap.parse_args(argv)
    print(table(args.logs, args.variants, scorer=args.scorer, gap=tuple(args.gap), context=args.context))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
