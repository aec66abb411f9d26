"""The same step shape's time in each ``bench=serve`` daemon, read from their decision logs.

Goodput's daemons have run slower than fixed k = 8's at the same work since 2026-12-05 (H100, 14:12
on 2026-12-06: the MQA graph at batch 4 and 20 tokens took 1.135-1.147 ms of device-event time in
goodput's daemon, 1.110-1.116 in k = 8's), which tok/s alone folds into the policy's choices. This
table shows it on every run: per concurrency N, the (scorer, tokens) shapes the most decode steps of
every config share, and for each config the median device ms of the scoring forward (``score_ms``,
CUDA events; a host delay between the events and the launch counts in it) and of the whole step
(``total_ms``) at that shape.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from specsched.bench.markdown import fmt, table
from specsched.engine.log_schema import LogFormatError, open_log

__all__ = ["shape_rows", "shape_table"]


def shape_rows(log_path: str | Path, config: str, concurrency: list[int]) -> list[dict]:
    """Per N and (scorer, num_tokens) of the log's last run's decode steps of batch size N: the
    number of steps and the median score and step ms."""
    try:
        db = open_log(log_path)
    except LogFormatError:
        return []
    run = db.execute("select max(id) from runs").fetchone()[0]
    out = []
    for n in concurrency:
        by = defaultdict(lambda: ([], []))
        for scorer, tokens, score, total in db.execute(
            "select scorer, num_tokens, score_ms, total_ms from steps where run_id = ? and kind = 'decode' "
            "and batch_size = ? and score_ms > 0", [run, n],
        ):  # fmt: skip
            by[(scorer, tokens)][0].append(score)
            by[(scorer, tokens)][1].append(total or 0.0)
        for (scorer, tokens), (scores, totals) in by.items():
            out.append({"config": config, "concurrency": n, "scorer": scorer, "num_tokens": tokens,
                        "num_steps": len(scores), "score_ms": statistics.median(scores),
                        "total_ms": statistics.median(totals)})  # fmt: skip
    return out


def shape_table(rows: list[dict], per_n: int = 2, min_steps: int = 20) -> str:
    """Per N the ``per_n`` shapes that the most configs ran at least ``min_steps`` times (at least
    two configs; ties: the most steps in the config with fewest), a cell per config ("–": fewer
    steps there); "" when no N has such a shape."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    lines = []
    for n in sorted({r["concurrency"] for r in rows}):
        at = {(r["config"], r["scorer"], r["num_tokens"]): r for r in rows
              if r["concurrency"] == n and r["num_steps"] >= min_steps}  # fmt: skip
        ranked = []
        for shape in {(s, t) for _, s, t in at}:
            counts = [at[(c, *shape)]["num_steps"] for c in configs if (c, *shape) in at]
            if len(counts) >= 2:
                ranked.append((len(counts), min(counts), shape))
        for _, _, (scorer, tokens) in sorted(ranked, reverse=True)[:per_n]:
            cells = []
            for c in configs:
                r = at.get((c, scorer, tokens))
                cells.append(
                    f"{fmt(r['score_ms'], 3)} / {fmt(r['total_ms'], 3)} ({r['num_steps']})" if r else "–"
                )
            lines.append([str(n), scorer, str(tokens), *cells])
    if not lines:
        return ""
    header = ["N", "scorer", "tokens", *[f"{c}: score / step ms (steps)" for c in configs]]
    return table(header, lines)
