"""The replica table of ``bench.serve.replicas`` (bench/serve_rounds.py): each config's tok/s by the
daemon process that served the round.

A daemon keeps the host speed it started with for its whole life: on an H100 on 2026-12-07 the same
step shape's scoring event took 1.284 ms in one config's daemon and 1.205 in another's, and two
daemons on the same code path ran every host phase 10-25 % apart (docs/benchmarks.md). Rounds
interleave the configs in time, not in placement, so such an offset stays in a config's mean however
many rounds run. With R replicas a config's rounds alternate between R processes; this table sets
their tok/s side by side: a gap between the replicas of one config is a per-process offset, and the
targets' margins mean nothing below it.
"""

from __future__ import annotations

import statistics

from specsched.bench.markdown import fmt, table

__all__ = ["replica_note", "replica_rates", "replica_table"]


def replica_rates(rows: list[dict]) -> dict[tuple[str, int], dict[int, list[float]]]:
    """(config, N) -> replica (1-based) -> the tok/s of the rounds it served: from dealt passes'
    ``round_tok_s`` / ``round_replica`` (the same for every pass of a (config, N)), or from the rows of
    one round each (``replica``). Rows with errors are left out."""
    out: dict[tuple[str, int], dict[int, list[float]]] = {}
    seen: set[tuple[str, int]] = set()
    for r in rows:
        if r.get("num_errors") or r.get("error"):
            continue
        key = (r["config"], r["concurrency"])
        if r.get("round_replica") and r.get("round_tok_s"):
            if key in seen:  # every dealt pass carries the same rounds
                continue
            seen.add(key)
            for k, tok in zip(r["round_replica"], r["round_tok_s"], strict=True):
                out.setdefault(key, {}).setdefault(k, []).append(tok)
        elif r.get("replica") is not None and r.get("tokens_per_s") is not None:
            out.setdefault(key, {}).setdefault(r["replica"], []).append(r["tokens_per_s"])
    return out


def replica_table(rows: list[dict]) -> str:
    """Per (config, N): each replica's rounds and median tok/s, and the largest median over the
    smallest − 1. Empty without replicas."""
    rates = replica_rates(rows)
    if not rates:
        return ""
    num = max(max(by) for by in rates.values())
    out = []
    for (config, n), by in rates.items():
        medians = [statistics.median(v) for v in by.values()]
        cells = [f"{fmt(statistics.median(by[k]), 1)} ({len(by[k])})" if k in by else "–"
                 for k in range(1, num + 1)]  # fmt: skip
        gap = f"{max(medians) / min(medians) - 1:.1%}" if len(medians) > 1 and min(medians) > 0 else "–"
        out.append([config, str(n), *cells, gap])
    header = ["config", "N", *[f"replica {k}: median tok/s (rounds)" for k in range(1, num + 1)],
              "largest / smallest − 1"]  # fmt: skip
    return table(header, out)


def replica_note() -> str:
    return (
        "Tok/s by daemon replica (`bench.serve.replicas`: each config served by that many daemon "
        "processes, round r at the i-th N on replica (r + i) mod R; a gap between one config's replicas "
        "is that process's own host speed, which rounds in time do not average out; "
        "bench/serve_replicas.py):"
    )
