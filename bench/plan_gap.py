"""Why one daemon's decode steps yield fewer tokens per millisecond than another's, from decision logs.

``python -m specsched.bench.plan_gap ref.sqlite other.sqlite [...] --batch 1 4 16 64 [--out t.md]``
(``cell.sqlite:3``: run 3 of a file with many runs, as the regret grid's logs are)

Per log (its last run) and batch size, over the decode steps of exactly that batch:

- *tok/step*: tokens emitted per step (accepted drafts + one bonus or recovered token per request);
- *step ms*: what a step costs the daemon, ``total_ms`` plus the loop's ``between`` before it
  (engine/step_timer.py), mean, median and p90;
- *tok/ms* = mean tok/step / mean step ms, the batch size's throughput;
- the gap against the first log, split as ``tok/ms % ≈ tok/step % − step ms %`` (exactly
  ``(1 + a) / (1 + b) − 1``): fewer tokens per step (the plans) or longer steps (the host, the scorer);
- *k / cap*: drafts proposed over the most the policy could have given (``step_requests.max_k``, the
  proposer's match and the length caps) and the share of request-steps drafting below their cap;
- *accept.*: accepted over proposed drafts;
- *slow decides*: the share of steps whose critical-path ``decide`` phase took over ``--decide-ms``
  (a plan not decided ahead) and the mean step ms of those steps;
- *explore*: the share of steps planned as a probe, a dither or a try (``plan_info``; goodput only);
- the scorers' shares of the steps.

Written for issue 12 (goodput 3-8 % behind fixed k = 8 on the MQA graph at N = 1, 4 and 64 on the
H200, 2026-12-05 01:40) to tell its plans from its step times.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from specsched.bench.markdown import emit, fmt, log_name, table
from specsched.engine.log_schema import open_log


@dataclass
class BatchSteps:
    """The decode steps of one batch size in one log."""

    step_ms: list[float] = field(default_factory=list)  # total_ms + between, one per step
    num_emitted: int = 0
    num_drafts: int = 0  # Σ k over request-steps
    num_cap: int = 0  # Σ max_k over request-steps that have one
    num_accepted: int = 0
    num_request_steps: int = 0
    num_below_cap: int = 0  # request-steps with k < max_k
    slow_decide_ms: list[float] = field(default_factory=list)  # step ms of the steps with a slow decide
    num_explore: int = 0
    scorers: Counter = field(default_factory=Counter)

    @property
    def num_steps(self) -> int:
        return len(self.step_ms)

    @property
    def tokens_per_step(self) -> float:
        return self.num_emitted / self.num_steps

    @property
    def mean_ms(self) -> float:
        return sum(self.step_ms) / self.num_steps

    @property
    def tokens_per_ms(self) -> float:
        return self.num_emitted / sum(self.step_ms)

    def quantile(self, q: float) -> float:
        xs = sorted(self.step_ms)
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def read_log(
    path: str, batch_sizes: Sequence[int], decide_ms: float = 0.1, run_id: int | None = None
) -> dict[int, BatchSteps]:
    """Run ``run_id``'s (default: the last run's) decode steps of each batch size in ``batch_sizes``
    (module docstring)."""
    db = open_log(path)
    run = run_id if run_id is not None else db.execute("select max(id) from runs").fetchone()[0]
    if db.execute("select count(*) from runs where id = ?", [run]).fetchone()[0] == 0:
        raise ValueError(f"{path}: no run {run} (runs.id)")
    wanted = set(batch_sizes)
    out = {b: BatchSteps() for b in batch_sizes}
    steps = {}
    for row in db.query(
        "select step, batch_size, total_ms, scorer, num_emitted, host_ms, plan_info from steps "
        "where run_id = ? and kind = 'decode'", [run],
    ):  # fmt: skip
        if row["batch_size"] not in wanted or row["total_ms"] is None:
            continue
        host = json.loads(row["host_ms"]) if row["host_ms"] else {}
        info = _json(row["plan_info"])
        s = out[row["batch_size"]]
        ms = row["total_ms"] + host.get("between", 0.0)
        s.step_ms.append(ms)
        s.num_emitted += row["num_emitted"] or 0
        s.scorers[row["scorer"]] += 1
        if host.get("decide", 0.0) > decide_ms:
            s.slow_decide_ms.append(ms)
        s.num_explore += bool(info.get("is_probe") or info.get("is_dither") or info.get("is_try"))
        steps[row["step"]] = s
    for row in db.query(
        "select step, k, num_accepted, max_k from step_requests where run_id = ?", [run]
    ):  # fmt: skip
        s = steps.get(row["step"])
        if s is None:
            continue
        k = row["k"] or 0
        s.num_request_steps += 1
        s.num_drafts += k
        s.num_accepted += row["num_accepted"] or 0
        if row["max_k"] is not None:
            s.num_cap += row["max_k"]
            s.num_below_cap += k < row["max_k"]
    return out


def _json(text: str | None) -> dict:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _pct(a: float, b: float) -> str:
    return f"{100.0 * (a / b - 1.0):+.1f} %"


HEAD = ["log", "batch", "steps", "tok/step", "step ms mean / p50 / p90", "tok/ms", "tok/step vs ref",
        "step ms vs ref", "tok/ms vs ref", "k / cap", "below cap", "accept.", "slow decides (step ms)",
        "explore", "scorers"]  # fmt: skip


def gap_rows(logs: dict[str, dict[int, BatchSteps]], batch_sizes: Sequence[int]) -> list[list[str]]:
    ref = next(iter(logs.values()))
    rows = []
    for b in batch_sizes:
        r = ref[b]
        for name, by in logs.items():
            s = by[b]
            if not s.num_steps:
                rows.append([name, str(b), "0"] + ["–"] * (len(HEAD) - 3))
                continue
            vs = (
                [_pct(s.tokens_per_step, r.tokens_per_step), _pct(s.mean_ms, r.mean_ms),
                 _pct(s.tokens_per_ms, r.tokens_per_ms)]
                if r.num_steps else ["–"] * 3
            )  # fmt: skip
            slow = len(s.slow_decide_ms) / s.num_steps
            slow_ms = sum(s.slow_decide_ms) / len(s.slow_decide_ms) if s.slow_decide_ms else None
            scorers = ", ".join(f"{k} {v / s.num_steps:.0%}" for k, v in s.scorers.most_common())
            rows.append([
                name, str(b), str(s.num_steps), fmt(s.tokens_per_step),
                f"{fmt(s.mean_ms, 3)} / {fmt(s.quantile(0.5), 3)} / {fmt(s.quantile(0.9), 3)}",
                fmt(s.tokens_per_ms, 3),
                *vs,
                f"{s.num_drafts / s.num_cap:.2f}" if s.num_cap else "–",
                f"{s.num_below_cap / s.num_request_steps:.0%}" if s.num_request_steps else "–",
                f"{s.num_accepted / s.num_drafts:.2f}" if s.num_drafts else "–",
                f"{slow:.0%}" + (f" ({fmt(slow_ms, 3)})" if slow_ms is not None else ""),
                f"{s.num_explore / s.num_steps:.0%}", scorers,
            ])  # fmt: skip
    return rows


def compare(logs: Sequence[str], batch_sizes: Sequence[int], decide_ms: float = 0.1) -> str:
    """``logs``: paths, each optionally ``PATH:RUN_ID`` (one run of a file with many, e.g. a regret
    cell's log)."""
    read = {}
    for spec in logs:
        path, run_id = split_run(spec)
        read[log_name(path) + (f":{run_id}" if run_id is not None else "")] = read_log(
            path, batch_sizes, decide_ms, run_id
        )
    return table(HEAD, gap_rows(read, batch_sizes))


def split_run(spec: str) -> tuple[str, int | None]:
    """``"a.sqlite:3"`` -> ``("a.sqlite", 3)``; a path without ``:N`` -> ``(path, None)``."""
    path, sep, tail = spec.rpartition(":")
    return (path, int(tail)) if sep and tail.isdigit() else (spec, None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specsched.bench.plan_gap", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "logs", nargs="+", help="decision logs (PATH or PATH:RUN_ID); the first is the reference"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument(
        "--decide-ms", type=float, default=0.1, help="a critical-path decide above this is slow"
    )
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args(argv)
    text = compare(args.logs, args.batch, args.decide_ms)
    emit(text + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
