"""The tables of ``bench=serve``'s rounds mode (bench/serve_rounds.py) in its report: the targets
round by round (:func:`paired_table`, with each round's host ms beside its tok/s) and the tok/s of
each round's loop or each slice of it (:func:`slices_table`); :func:`mean_tok_s` and the goals are the
targets table's too (bench/serve_report.py)."""

from __future__ import annotations

import statistics
from collections import defaultdict

from specsched.bench.markdown import fmt, table

__all__ = ["HOST_MATCH", "LEAD_GOAL", "mean_tok_s", "paired_table", "slices_table"]

LEAD_GOAL = 0.03  # goodput >= the best fixed row - 3%
HOST_MATCH = 0.05  # two loops of a round whose host ms are this close: compared on equal terms


def mean_tok_s(rows: list[dict]) -> dict[tuple[str, int], float]:
    """(config, N) -> mean tok/s over its passes (rows without errors only)."""
    acc: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in rows:
        if not r["num_errors"] and not r.get("error"):
            acc[(r["config"], r["concurrency"])].append(r["tokens_per_s"])
    return {k: statistics.fmean(v) for k, v in acc.items()}


def paired_table(res: dict) -> str:
    """The targets' ratios per round (bench=serve_rounds): every config runs one loop in each round,
    in the same stretch of the host's time, so a drift of the host's speed between rounds hits them
    alike and cancels in the ratio of two configs' loops of one round; the pooled passes above do not
    cancel it. Per N: the default config's tok/s over the best fixed row's (chosen as in the targets
    table) and over the baseline's, round by round: median [min–max]; then each other policy's
    (kind ``policy``: an A/B row) the same way. With the decision logs (``round_host_ms``,
    bench/serve_drift.py): the ratio of the two loops' host ms round by round, and the tok/s ratio over
    the rounds where those were within ``HOST_MATCH`` of each other (a round where one daemon's host ran
    slower than the other's in the same seconds says little about the configs). Empty without round
    tok/s."""
    rounds: dict[tuple[str, int], list[float]] = {}
    hosts: dict[tuple[str, int], list[float]] = {}
    for r in res["rows"]:
        if r.get("round_tok_s") and not r["num_errors"] and not r.get("error"):
            rounds.setdefault((r["config"], r["concurrency"]), r["round_tok_s"])
            if r.get("round_host_ms") and len(r["round_host_ms"]) == len(r["round_tok_s"]):
                hosts.setdefault((r["config"], r["concurrency"]), r["round_host_ms"])
    kinds = {c["name"]: c["kind"] for c in res["configs"]}
    default = next((n for n, k in kinds.items() if k == "default"), None)
    base = next((n for n, k in kinds.items() if k == "baseline"), None)
    policies = [default] + [c for c, k in kinds.items() if k == "policy"]
    tok, out = mean_tok_s(res["rows"]), []
    for n in sorted({n for _, n in rounds}):
        best = max(((tok[(c, n)], c) for c, k in kinds.items() if k == "fixed" and (c, n) in rounds),
                   default=None)  # fmt: skip
        for config in policies:
            g = rounds.get((config, n))
            if not g or best is None:
                continue
            pairs = list(zip(g, rounds[(best[1], n)]))
            vs_best = [a / b - 1 for a, b in pairs if b > 0]
            vs_base = [a / b for a, b in zip(g, rounds.get((base, n)) or []) if b > 0]
            mine, theirs = hosts.get((config, n)), hosts.get((best[1], n))
            host, matched = "–", "–"
            if mine and theirs and len(mine) == len(theirs) == len(pairs):
                ratios = [a / b for a, b in zip(mine, theirs) if b > 0]
                host = _median_range([x - 1 for x in ratios], "{:+.0%}")
                kept = [a / b - 1 for (a, b), h in zip(pairs, ratios) if b > 0 and abs(h - 1) <= HOST_MATCH]
                matched = f"{_median_range(kept, '{:+.1%}')} ({len(kept)})" if kept else "– (0)"
            out.append([str(n), config, best[1], str(len(vs_best)), _median_range(vs_best, "{:+.1%}"),
                        f"{sum(v >= -LEAD_GOAL for v in vs_best)} / {len(vs_best)}",
                        _median_range(vs_base, "{:.2f}"), host, matched])  # fmt: skip
    if not out:
        return ""
    header = ["N", "config", "best fixed row", "rounds", "vs it, per round: median [min–max]",
              "rounds ≥ −3%", "× non-spec, per round: median [min–max]",
              "its loop's host ms vs the fixed row's, per round",
              "vs it where host ms within ±5% (rounds)"]  # fmt: skip
    return table(header, out)


def _median_range(values: list[float], form: str) -> str:
    if not values:
        return "–"
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{form.format(mid)} [{form.format(lo)} – {form.format(hi)}]"


def slices_table(rows: list[dict], key: str = "slice_tok_s", what: str = "slice") -> str:
    """Interleaved passes: the tok/s of each loop's slices (what one slice-long pass would measure), or
    (``key`` round_tok_s) of each round's whole loop."""
    seen: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        if r.get(key):
            seen.setdefault((r["config"], r["concurrency"]), r[key])
    out = [[c, str(n), str(len(v)), fmt(min(v), 1), fmt(statistics.median(v), 1), fmt(max(v), 1),
            f"{100 * (max(v) / min(v) - 1):.0f}%" if min(v) > 0 else "–"]
           for (c, n), v in seen.items()]  # fmt: skip
    if not out:
        return ""
    header = ["config", "N", f"{what}s", f"{what} tok/s min", "median", "max", "max / min − 1"]
    return table(header, out)
