"""Config A vs config B on ``bench=serve``'s decision logs, paired by prompt: how much of a tok/s
difference is the decisions (tokens per request-step) and how much the time per step.

``python -m specsched.bench.serve_paired --ref a.sqlite --log b.sqlite [--log c.sqlite ...]
[--batch 1 4 16 64] [--max-k 8] [--min-steps 30]``

Two daemons' tok/s are hard to compare directly: each serves its own mix of the prompts (a faster
config gets through more requests of some prompts), and n-gram acceptance differs up to 5x between
prompts. So, for each log and batch size N, over the decode steps with ``batch_size == N`` (all runs
of the log):

- a **request-step** is one request in one decode step (a ``step_requests`` row). Per prompt: their
  number, the **emitted per request-step** (mean ``num_emitted``), the **drafts taken** = sum(k) /
  sum(min(max_k, K)), K = ``--max-k`` (the share of the drafts offered that the policy verified), and
  the **offer share** = the share of request-steps with ``max_k > 0``.
- a prompt is identified by its length, ``requests.prompt_tokens``: the benchmark's prompts have
  distinct lengths. Two prompts of one length would be pooled as one.
- the **wall ms per decode step**: start_time of the run's next step minus its own, for the steps of
  kind decode with ``batch_size == N`` (device and host time, the daemon loop in between); gaps over
  ``IDLE_MS`` are idle time and dropped. Gaps never cross runs.

Against the reference log (``--ref``), for each other log (``--log``, labelled by its file stem):

- the **paired token ratio**: per prompt with >= ``--min-steps`` request-steps in both logs, emitted
  per request-step (log / ref); median, min and max over prompts, and the **weighted** ratio =
  sum(n_ref * rate_log) / sum(n_ref * rate_ref) over the paired prompts (n_ref: the ref's
  request-steps of the prompt), i.e. both logs on the ref's mix. ``unpaired`` is the plain ratio of
  the logs' emitted per request-step, mix included.
- the **step time ratio**: mean wall ms per decode step (log / ref).
- the **predicted tok/s** vs ref = weighted paired token ratio / step time ratio, as a change in %.
  It leaves out prefills and the batch's fill (the share of steps at each N), so it approximates
  the tok/s ratio of a pass at that N.

The drafts-taken column pools all request-steps of the N (all prompts: it carries the mix).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specsched.bench.markdown import fmt, table
from specsched.engine.log_schema import LogFormatError, open_log

if TYPE_CHECKING:
    from sqlite_utils import Database

IDLE_MS = 50.0  # a gap between two steps above this is idle time, not a step's
TABLES = ("steps", "step_requests", "requests")


class LogError(ValueError):
    """A path that is not a readable decision log (the message names the path, and the table)."""


@dataclass
class PromptRate:
    """One prompt's decode request-steps at one batch size (see the module docstring)."""

    prompt_tokens: int
    steps: int  # request-steps
    emitted: int  # sum(num_emitted)
    drafts: int  # sum(k)
    offered: int  # sum(min(max_k, K))
    with_offer: int  # request-steps with max_k > 0

    @property
    def per_step(self) -> float:
        return self.emitted / self.steps

    @property
    def drafts_taken(self) -> float | None:
        return self.drafts / self.offered if self.offered else None

    @property
    def offer_share(self) -> float:
        return self.with_offer / self.steps


def connect(path: str | Path) -> Database:
    """The log, read through :func:`~specsched.engine.log_schema.open_log` (a specsched log of a
    readable schema version), after checking it has ``TABLES``; :class:`LogError` otherwise."""
    if not Path(path).is_file():
        raise LogError(f"{path}: no such file")
    try:
        db = open_log(path)
    except LogFormatError as e:
        raise LogError(f"{path}: not an SQLite decision log ({e})") from e
    have = set(db.table_names())
    for t in TABLES:
        if t not in have:
            db.conn.close()
            raise LogError(f"{path}: no table {t!r} (not a decision log of bench=serve?)")
    return db


def _query(path: str | Path, sql: str, params: Sequence = ()) -> list[tuple]:
    db = connect(path)
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.conn.close()


def prompt_rates(db_path: str | Path, batch: int, max_k: int = 8) -> dict[int, PromptRate]:
    """Per prompt length: its decode request-steps at batch size ``batch``."""
    rows = _query(
        db_path,
        "select r.prompt_tokens, count(*), sum(sr.num_emitted), sum(coalesce(sr.k, 0)), "
        "sum(min(coalesce(sr.max_k, 0), ?)), sum(coalesce(sr.max_k, 0) > 0) from step_requests sr "
        "join steps s on s.run_id = sr.run_id and s.step = sr.step "
        "join requests r on r.run_id = sr.run_id and r.request_id = sr.request_id "
        "where s.kind = 'decode' and s.batch_size = ? group by r.prompt_tokens",
        [max_k, batch],
    )
    return {r[0]: PromptRate(*r) for r in rows}


def step_wall_ms(db_path: str | Path, batch: int, idle_ms: float = IDLE_MS) -> list[float]:
    """Wall ms of each decode step of batch size ``batch``: the gap to its run's next step, gaps over
    ``idle_ms`` dropped."""
    rows = _query(db_path, "select run_id, kind, batch_size, start_time from steps order by run_id, step")
    out = []
    for (run, kind, n, t), (run_next, _, _, t_next) in zip(rows, rows[1:]):
        gap = (t_next - t) * 1e3
        if run == run_next and kind == "decode" and n == batch and gap <= idle_ms:
            out.append(gap)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _pooled(rates: dict[int, PromptRate]) -> tuple[float | None, float | None]:
    """Emitted per request-step and drafts taken over all prompts."""
    steps = sum(p.steps for p in rates.values())
    offered = sum(p.offered for p in rates.values())
    return (
        sum(p.emitted for p in rates.values()) / steps if steps else None,
        sum(p.drafts for p in rates.values()) / offered if offered else None,
    )


def pair_row(ref: dict[int, PromptRate], log: dict[int, PromptRate], min_steps: int) -> dict:
    """The paired token ratios of ``log`` against ``ref`` (module docstring)."""
    paired = sorted(p for p in ref.keys() & log.keys() if min(ref[p].steps, log[p].steps) >= min_steps)
    ratios = [log[p].per_step / ref[p].per_step for p in paired if ref[p].emitted]
    on_ref_mix = [(ref[p].steps * log[p].per_step, ref[p].steps * ref[p].per_step) for p in paired]
    weighted = _ratio(sum(a for a, _ in on_ref_mix), sum(b for _, b in on_ref_mix))
    (log_rate, log_taken), (ref_rate, ref_taken) = _pooled(log), _pooled(ref)
    return {"paired": paired, "median": statistics.median(ratios) if ratios else None,
            "min": min(ratios, default=None), "max": max(ratios, default=None), "weighted": weighted,
            "unpaired": _ratio(log_rate, ref_rate), "taken": log_taken, "ref_taken": ref_taken}  # fmt: skip


def paired_rows(
    ref: str | Path, logs: Sequence[str | Path], batches: Sequence[int] = (1, 4, 16, 64),
    max_k: int = 8, min_steps: int = 30,
) -> list[dict]:  # fmt: skip
    """One row per (log, N): ``config``, ``N``, :func:`pair_row`'s keys, the step ms (``ms_mean``,
    ``ms_median``, ``ref_ms_mean``, ``ref_ms_median``), ``step_ratio`` and ``predicted`` (the tok/s
    ratio); a row with ``skipped`` set (and nothing else) where the log or the ref has no decode
    steps of batch size N."""
    out = []
    for n in batches:
        ref_rates, ref_ms = prompt_rates(ref, n, max_k), step_wall_ms(ref, n)
        for log in logs:
            row: dict = {"config": label(log), "N": n}
            rates, ms = prompt_rates(log, n, max_k), step_wall_ms(log, n)
            if not (rates and ms and ref_rates and ref_ms):
                empty = [p for p, r, m in ((ref, ref_rates, ref_ms), (log, rates, ms)) if not (r and m)]
                out.append({**row, "skipped": ", ".join(f"`{label(e)}`" for e in empty)})
                continue
            row |= pair_row(ref_rates, rates, min_steps)
            row |= {"ms_mean": statistics.fmean(ms), "ms_median": statistics.median(ms)}
            row |= {"ref_ms_mean": statistics.fmean(ref_ms), "ref_ms_median": statistics.median(ref_ms)}
            row["step_ratio"] = row["ms_mean"] / row["ref_ms_mean"]
            row["predicted"] = _ratio(row["weighted"], row["step_ratio"])
            out.append(row)
    return out


def _pct(ratio: float | None) -> str:
    return "–" if ratio is None else f"{(ratio - 1) * 100:+.1f} %"


def _vs(a: float | None, b: float | None, digits: int) -> str:
    return f"{fmt(a, digits)} vs {fmt(b, digits)}"


HEADER = ["config", "N", "prompts paired", "tokens/request-step ratio median [min–max]", "weighted",
          "unpaired", "drafts taken (log vs ref)", "step ms mean (log vs ref)", "step ms median",
          "step time ratio", "predicted tok/s vs ref"]  # fmt: skip


def paired_markdown(ref: str | Path, rows: list[dict]) -> str:
    """The table of :func:`paired_rows`, with a line per skipped (log, N) under it."""
    body = []
    for r in (r for r in rows if "skipped" not in r):
        spread = f"{fmt(r['median'], 3)} [{fmt(r['min'], 3)}–{fmt(r['max'], 3)}]"
        body.append([r["config"], str(r["N"]), str(len(r["paired"])), spread, fmt(r["weighted"], 3),
                     fmt(r["unpaired"], 3), _vs(r["taken"], r["ref_taken"], 3),
                     _vs(r["ms_mean"], r["ref_ms_mean"], 2), _vs(r["ms_median"], r["ref_ms_median"], 2),
                     fmt(r["step_ratio"], 3), _pct(r["predicted"])])  # fmt: skip
    lines = [f"Reference: `{label(ref)}`.", "", table(HEADER, body)]
    skipped = [f"- skipped `{r['config']}` at N={r['N']}: no decode steps of that size in {r['skipped']}"
               for r in rows if "skipped" in r]  # fmt: skip
    return "\n".join(lines + ([""] + skipped if skipped else [])) + "\n"


def label(path: str | Path) -> str:
    return Path(path).stem


def serve_by_prompt(logs: dict[str, tuple[str, Path]], batches: Sequence[int]) -> str | None:
    """``bench=serve``'s table of this module: ``logs`` maps each config's name to (its kind, its
    decision log); the reference is the first ``fixed`` config with a log, compared with every
    ``policy`` and ``default`` one. None when there is no such pair or a log cannot be read."""
    found = serve_by_prompt_rows(logs, batches)
    return None if found is None else found[0]


def serve_by_prompt_rows(
    logs: dict[str, tuple[str, Path]], batches: Sequence[int]
) -> tuple[str, list[dict]] | None:
    """:func:`serve_by_prompt`'s table and the :func:`paired_rows` it shows (for results.json: the
    runs' pooling, bench/serve_runs.py, reads them)."""
    present = {name: (kind, path) for name, (kind, path) in logs.items() if Path(path).is_file()}
    ref = next((path for kind, path in present.values() if kind == "fixed"), None)
    others = [path for kind, path in present.values() if kind in ("policy", "default")]
    if ref is None or not others:
        return None
    try:
        rows = paired_rows(ref, others, batches)
    except LogError:
        return None
    return paired_markdown(ref, rows), rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], prog="python -m specsched.bench.serve_paired"
    )
    ap.add_argument("--ref", action="append", required=True, help="the reference log (the first one)")
    ap.add_argument("--log", action="append", required=True, help="a log to compare with the ref (repeat)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64], help="the batch sizes N")
    ap.add_argument("--max-k", type=int, default=8, help="K: drafts offered are min(max_k, K)")
    ap.add_argument("--min-steps", type=int, default=30, help="request-steps a prompt needs in both logs")
    args = ap.parse_args(argv)
    try:
        rows = paired_rows(args.ref[0], args.log, args.batch, args.max_k, args.min_steps)
    except LogError as e:
        ap.error(str(e))
    sys.stdout.write(paired_markdown(args.ref[0], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
