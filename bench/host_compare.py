"""Where one daemon's decode steps spend more host time than another's, read from decision logs.

``python -m specsched.bench.host_compare a.sqlite b.sqlite [...] --batch 4 16 [--out t.md]``

For each log (its last run) and batch size: the decode steps of exactly that batch, split into the
steps that **decided ahead** (their scoring overlapped the next step's decide: the next step runs a
plan with ``plan_info.is_planned_ahead`` and ``plan_age`` 0) and the others. Per group: the share
of steps, the mean step ms (``total_ms`` plus the loop's ``between`` before it: what each step
costs the daemon), the device score ms, and per host phase (``steps.host_ms``, engine/step_timer.py)
the median and the mean. A second table gives, for each phase, each log's mean over all its steps
minus the first log's: the milliseconds a step pays there beyond the reference.

Written for issue 12 (goodput 0.2 ms a step slower than fixed k = 8 at N = 4-16 on the H200,
2026-12-04 18:54): it splits that difference into the decides ahead that the GPU does not hide and
the rest.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from specsched.bench.markdown import emit, fmt, log_name, table
from specsched.bench.serve_host import PHASES
from specsched.engine.log_schema import open_log

GROUPS = ("ahead", "other")


@dataclass
class StepGroup:
    """Decode steps of one batch size in one log, one of :data:`GROUPS`."""

    step_ms: list[float] = field(default_factory=list)  # total_ms + between
    score_ms: list[float] = field(default_factory=list)  # device (event) ms
    phases: dict[str, list[float]] = field(default_factory=dict)  # host ms per phase, one per step

    def add(self, total_ms: float, score_ms: float, host: dict[str, float]) -> None:
        self.step_ms.append(total_ms + host.get("between", 0.0))
        self.score_ms.append(score_ms)
        for p in PHASES:
            self.phases.setdefault(p, []).append(host.get(p, 0.0))

    def __len__(self) -> int:
        return len(self.step_ms)


def decode_groups(path: str, batch_sizes: Sequence[int]) -> dict[int, dict[str, StepGroup]]:
    """The last run's decode steps of each batch size in ``batch_sizes``, by group (module docstring).
    A step decided ahead when the decode step right after it runs a fresh plan decided ahead."""
    db = open_log(path)
    run = db.execute("select max(id) from runs").fetchone()[0]
    rows = list(db.query(
        "select step, batch_size, total_ms, score_ms, host_ms, plan_info from steps "
        "where run_id = ? and kind = 'decode' order by step", [run],
    ))  # fmt: skip
    out = {b: {g: StepGroup() for g in GROUPS} for b in batch_sizes}
    for i, r in enumerate(rows):
        if r["batch_size"] not in out or not r["host_ms"]:
            continue
        nxt = rows[i + 1] if i + 1 < len(rows) and rows[i + 1]["step"] == r["step"] + 1 else None
        info = json.loads(nxt["plan_info"]) if nxt is not None and nxt["plan_info"] else {}
        ahead = bool(info.get("is_planned_ahead")) and not info.get("plan_age")
        host = json.loads(r["host_ms"])
        out[r["batch_size"]]["ahead" if ahead else "other"].add(
            r["total_ms"] or 0.0, r["score_ms"] or 0.0, host
        )
    return out


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def all_steps(groups: dict[str, StepGroup]) -> StepGroup:
    merged = StepGroup()
    for g in groups.values():
        merged.step_ms += g.step_ms
        merged.score_ms += g.score_ms
        for p, xs in g.phases.items():
            merged.phases.setdefault(p, []).extend(xs)
    return merged


def group_rows(logs: dict[str, dict[int, dict[str, StepGroup]]]) -> list[list[str]]:
    rows = []
    for name, by_batch in logs.items():
        for b, groups in by_batch.items():
            n = sum(len(g) for g in groups.values())
            for gname, g in groups.items():
                if not len(g):
                    continue
                rows.append([
                    name, str(b), gname, str(len(g)), fmt(len(g) / n), fmt(_mean(g.step_ms), 3),
                    fmt(_mean(g.score_ms), 3),
                    *(f"{fmt(_median(g.phases[p]), 3)} / {fmt(_mean(g.phases[p]), 3)}" for p in PHASES),
                ])  # fmt: skip
    return rows


def delta_rows(logs: dict[str, dict[int, dict[str, StepGroup]]]) -> list[list[str]]:
    """Per batch size and log after the first: its mean ms per step minus the first log's, per phase."""
    names = list(logs)
    rows = []
    for b in logs[names[0]]:
        ref = all_steps(logs[names[0]][b])
        for name in names[1:]:
            cur = all_steps(logs[name][b])
            if not len(ref) or not len(cur):
                continue
            d = [_mean(cur.phases[p]) - _mean(ref.phases[p]) for p in PHASES]
            step = _mean(cur.step_ms) - _mean(ref.step_ms)
            score = _mean(cur.score_ms) - _mean(ref.score_ms)
            rows.append([name, str(b), f"{step:+.3f}", f"{score:+.3f}", *(f"{x:+.3f}" for x in d)])
    return rows


def compare(paths: Sequence[str], batch_sizes: Sequence[int]) -> str:
    logs = {log_name(p): decode_groups(p, batch_sizes) for p in paths}
    first = log_name(paths[0])
    parts = [
        "Decode steps by batch size and group (ahead = the step decided the next plan during its "
        "scoring); phase cells are median / mean host ms.",
        "",
        table(
            ["log", "batch", "group", "steps", "share", "step ms (mean)", "device score ms (mean)", *PHASES],
            group_rows(logs),
        ),  # fmt: skip
    ]
    deltas = delta_rows(logs)
    if deltas:
        parts += ["", f"Mean ms per step minus `{first}`'s, all steps of the batch size:", "",
                  table(["log", "batch", "step", "device score", *PHASES], deltas)]  # fmt: skip
    return "\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], prog="python -m specsched.bench.host_compare"
    )
    ap.add_argument("logs", nargs="+", help="decision logs; the first is the reference")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64], help="batch sizes")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args(argv)
    text = compare(args.logs, args.batch)
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
