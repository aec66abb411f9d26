"""Issue 12's targets over several runs of ``bench=serve`` (one tree, one or more machines).

One run's targets table says what that run measured; the host's speed drifts between runs by more
than the 3 % the line allows (2026-12-07 22:27 and 22:38, same tree and H100: goodput −5.0 and
+3.4 % against fixed k = 8 at N = 4), so a verdict on a tree needs several runs. This reads each run's
``results.json`` (``bench.out_dir``'s, or an unpacked lease directory that holds ``bench/results.json``)
and prints, per N, each run's goodput against the best fixed row and against the baseline
(:func:`specsched.bench.serve_report.target_rows`), their median and range over the runs, how many
runs met the line, and whether the medians meet it. Beside it, the half of the comparison the host's
speed does not move: the default config's tokens per request-step against the first fixed row's,
paired by prompt (bench/serve_paired.py, ``weighted``), and its step time ratio, each run and their
median — from the run's ``by_prompt_rows``, or computed from its decision logs (``logs/*.sqlite`` or
``.sqlite.gz``, as a lease's bundle leaves them) for a run that predates them.

``python -m specsched.bench.serve_runs RUN [RUN ...] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from specsched.bench.log_files import plain_log
from specsched.bench.markdown import emit, fmt, table
from specsched.bench.serve_daemon import safe_name
from specsched.bench.serve_paired import serve_by_prompt_rows
from specsched.bench.serve_report import SPREAD_GOAL, target_rows
from specsched.bench.serve_round_tables import LEAD_GOAL

__all__ = ["load_serve", "pool_targets", "token_rows", "pool_tokens", "runs_table", "main"]


def load_serve(path: str | Path) -> dict:
    """The ``serve`` result of a run, labelled with its date and device: ``path`` is a results.json, or
    a directory holding one (directly or under ``bench/``). Raises ValueError naming the path when it
    does not exist, holds no results.json, or has no serve result."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{path}: does not exist")
    if p.is_dir():
        found = [q for q in (p / "results.json", p / "bench" / "results.json") if q.is_file()]
        if not found:
            raise ValueError(f"{path}: no results.json in it or in its bench/ folder")
        p = found[0]
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: not a readable results.json ({e})") from None
    serve = data.get("serve") if isinstance(data, dict) else None
    if not isinstance(serve, dict) or "rows" not in serve or "configs" not in serve:
        raise ValueError(
            f"{p}: no bench=serve result in it (keys: {sorted(data) if isinstance(data, dict) else '-'})"
        )
    label = f"{data.get('date', '?')} {data.get('device', '')}".strip()
    return {
        **serve,
        "label": label,
        "run_dir": str(p.parent.parent if p.parent.name == "bench" else p.parent),
    }


def _spread(values: list[float]) -> tuple[float, float, float] | None:
    return (statistics.median(values), min(values), max(values)) if values else None


def pool_targets(results: Sequence[dict]) -> list[dict]:
    """Per N (the concurrencies of any run, in order): ``vs_best`` and ``vs_base`` of each run (None
    where that run lacks the N or a side), their (median, min, max) over the runs that have them,
    ``num_met`` / ``num_runs`` (runs with both sides at that N), and ``met`` on the medians."""
    per_run = [{t["concurrency"]: t for t in target_rows(r)} for r in results]
    out = []
    for n in sorted({n for targets in per_run for n in targets}):
        ts = [targets.get(n) for targets in per_run]
        best = [t["vs_best"] if t else None for t in ts]
        base = [t["vs_base"] if t else None for t in ts]
        both = [t for t in ts if t and t["met"] is not None]
        best_spread = _spread([v for v in best if v is not None])
        base_spread = _spread([v for v in base if v is not None])
        met = None
        if best_spread and base_spread:
            met = best_spread[0] >= -LEAD_GOAL and base_spread[0] >= 1
        out.append({
            "concurrency": n, "vs_best": best, "vs_base": base, "vs_best_spread": best_spread,
            "vs_base_spread": base_spread, "num_met": sum(bool(t["met"]) for t in both),
            "num_runs": len(both), "met": met,
        })  # fmt: skip
    return out


def token_rows(res: dict) -> list[dict]:
    """The default config's rows of :func:`~specsched.bench.serve_paired.paired_rows` (by prompt
    against the first fixed config) in a run: its ``by_prompt_rows``, else computed from the decision
    logs under ``run_dir``/logs (gzipped ones decompressed to a temporary folder); [] when neither."""
    kinds = [(c["name"], c["kind"]) for c in res["configs"]]
    default = next((safe_name(n) for n, k in kinds if k == "default"), None)
    rows = res.get("by_prompt_rows")
    if rows is None and res.get("run_dir"):
        logs = Path(res["run_dir"]) / "logs"
        with tempfile.TemporaryDirectory() as tmp:
            paths = {}
            for name, kind in kinds:  # the fixed ones (the first with a log is the reference), the default
                if kind not in ("fixed", "default"):
                    continue
                plain, packed = logs / f"{safe_name(name)}.sqlite", logs / f"{safe_name(name)}.sqlite.gz"
                if not plain.is_file() and packed.is_file():
                    plain = plain_log(packed, Path(tmp))
                paths[name] = (kind, plain)
            found = serve_by_prompt_rows(paths, sorted({r["concurrency"] for r in res["rows"]}))
            rows = [] if found is None else found[1]
    return [r for r in rows or [] if r["config"] == default and "skipped" not in r]


def pool_tokens(results: Sequence[dict]) -> list[dict]:
    """Per N: each run's ``weighted`` token ratio and ``step_ratio`` of the default config against
    the first fixed one (:func:`token_rows`; None where a run has none), and their (median, min, max)."""
    per_run = [{r["N"]: r for r in token_rows(res)} for res in results]
    out = []
    for n in sorted({n for rows in per_run for n in rows}):
        tokens = [rows[n]["weighted"] if n in rows else None for rows in per_run]
        steps = [rows[n]["step_ratio"] if n in rows else None for rows in per_run]
        out.append({
            "concurrency": n, "tokens": tokens, "steps": steps,
            "tokens_spread": _spread([v for v in tokens if v is not None]),
            "steps_spread": _spread([v for v in steps if v is not None]),
        })  # fmt: skip
    return out


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:+.1f} %"


def runs_table(results: Sequence[dict]) -> str:
    """Markdown: the runs, then the pooled targets per N (:func:`pool_targets`)."""
    runs = []
    for i, r in enumerate(results, 1):
        spreads = [row["spread"] for row in r["rows"] if row.get("spread") is not None]
        compiles = [row["compiles"] for row in r["rows"] if row.get("compiles") is not None]
        runs.append([str(i), r.get("label", "?"), f"{100 * max(spreads):.1f} %" if spreads else "–",
                     str(max(compiles)) if compiles else "–"])  # fmt: skip
    text = table(["run", "date, device", f"largest pass spread (≤ {100 * SPREAD_GOAL:.0f} %)",
                  "most compiles after start-up in a pass"], runs)  # fmt: skip
    rows = []
    for p in pool_targets(results):
        s, b = p["vs_best_spread"], p["vs_base_spread"]
        rows.append([
            str(p["concurrency"]), " / ".join(_pct(v) for v in p["vs_best"]),
            "–" if s is None else f"{_pct(s[0])} [{_pct(s[1])}, {_pct(s[2])}]",
            "–" if b is None else f"{fmt(b[0])} [{fmt(b[1])}, {fmt(b[2])}]",
            f"{p['num_met']} / {p['num_runs']}",
            "–" if p["met"] is None else ("yes" if p["met"] else "**no**"),
        ])  # fmt: skip
    header = ["N", "goodput vs best fixed, each run", "median [min, max]", "× non-spec, median [min, max]",
              "runs met", f"met on the medians (≥ −{100 * LEAD_GOAL:.0f} %, ≥ 1)"]  # fmt: skip
    text += "\n\n" + table(header, rows)
    pooled = pool_tokens(results)
    if pooled:
        body = []
        for p in pooled:
            t, s = p["tokens_spread"], p["steps_spread"]
            body.append([
                str(p["concurrency"]), " / ".join(fmt(v, 3) for v in p["tokens"]),
                "–" if t is None else f"{fmt(t[0], 3)} [{fmt(t[1], 3)}, {fmt(t[2], 3)}]",
                " / ".join(fmt(v, 3) for v in p["steps"]),
                "–" if s is None else f"{fmt(s[0], 3)} [{fmt(s[1], 3)}, {fmt(s[2], 3)}]",
            ])  # fmt: skip
        text += (
            "\n\nThe default config against the first fixed one by prompt (bench/serve_paired.py): tokens "
            "per request-step (weighted; the host's speed does not move it) and step time, each run:\n\n"
            + table(
                [
                    "N",
                    "tokens / request-step, each run",
                    "median [min, max]",
                    "step time, each run",
                    "median [min, max]",
                ],
                body,
            )  # fmt: skip
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m specsched.bench.serve_runs", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("runs", nargs="+", help="results.json files, or run directories holding one")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args(argv)
    try:
        results = [load_serve(r) for r in args.runs]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = runs_table(results)
    emit(text + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
