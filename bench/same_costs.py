"""Policies compared on one daemon's costs (issue 12): a policy's log replayed under itself and under
other logs' policies, so that every policy is priced by the same cost models.

``python -m specsched.bench.same_costs --replayed goodput.sqlite --other k8.sqlite [--other k5.sqlite
...] [--out table.md]``, or ``--run DIR`` for what a device call of ``bench/lease.sh`` brings back (its
``out.tar.part_*`` joined and unpacked: ``DIR/bench/results.json`` and ``DIR/logs/*.sqlite[.gz]``): the
default config's log replayed against the fixed rows' and the non-speculative row's
(:func:`run_logs`).

``bench=serve`` runs each config in a daemon of its own, and a daemon keeps the host speed it started
with: on an H100 on 2026-12-07 goodput's tok/s against fixed k = 8 went −13.7 / +10.6 % live in two
cells where, replayed on goodput's log, the two came within 0.3 % (docs/benchmarks.md, "Replay on the
same daemon's costs"). Live ratios there compare daemons as much as policies. Here the ``--replayed``
log's policy (its ``runs.config``) is replayed on its own match bits and refitted cost models
(:func:`specsched.bench.replay_fidelity.predicted_rates`: pass by pass, closed loop, windowed as live),
and so is each ``--other`` log's recorded policy; per concurrency the table sets the replayed policy's
predicted tok/s against each other policy's on the same costs, and beside it the live ratio of the two
logs. A gap between the two ratios is the daemons, not the policies; the same-cost ratio is itself a
replay, within its self-replay error (the ``self error`` column: predicted against live for the
replayed log), and a policy whose steps the replayed log rarely ran (another scorer, another batch
range) is priced from thin data (the last column; e.g. non-speculative batch expansion at batch 64 on
goodput's log, which ran the MQA graph there; a drafting policy on a log that drafted little in
that scorer and batch range counts too: bench/replay_fidelity.py ``coverage``). The replayed log's
decide spill is left out for a
policy that does not decide ahead (:func:`specsched.policies.replay_costs.costs_for`), as in the fidelity
table. The other log's policy node is replayed with how its daemon served: its runs of plain steps
(``scheduler.decode_steps`` / ``plain_decode_steps``: non-speculative serving's runs alone, goodput's
runs for declined drafts; policies/replay_runs.py) and a proposer of ``none``
(:func:`specsched.bench.replay_fidelity.engine_options`). Other options (the rest of ``scheduler.*``,
``model.*``) are the replayed log's, so two logs of one policy and run options price alike and their
live ratio is their daemons' (and those options') difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from specsched.bench.log_files import plain_log
from specsched.bench.markdown import emit, fmt, log_name, table
from specsched.bench.replay_fidelity import THIN_STEPS, LoadedLog, Rate, live_rates, load_log, predicted_rates
from specsched.bench.serve_daemon import safe_name
from specsched.policies.replay import policy_label

__all__ = ["same_cost_rows", "run_logs", "main"]

HEADER = ["N", "policy (replayed log)", "other policy (its log)", "policy tok/s, same costs",
          "other tok/s, same costs", "policy / other, same costs", "policy / other, live",
          "policy self error %", f"other: % steps priced from < {THIN_STEPS} logged"]  # fmt: skip


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b - 1:+.1%}" if a and b else "–"


def same_cost_rows(
    replayed: LoadedLog, others: Sequence[tuple[str, LoadedLog]], name: str
) -> list[list[str]]:
    """One row per other log and concurrency (``all``: every pass): the replayed log's policy and the
    other log's policy, both replayed on ``replayed``; their ratio, and the two logs' live ratio."""
    policy = replayed.run.settings.policy
    if policy is None:
        raise ValueError(f"{name}: no policy recorded in the log's runs.config")
    own, own_live = predicted_rates(replayed, policy), live_rates(replayed)
    rows = []
    for other_name, other in others:
        theirs = other.run.settings.policy
        if theirs is None:
            raise ValueError(f"{other_name}: no policy recorded in the log's runs.config")
        pred, their_live = predicted_rates(replayed, theirs, engine=other.run.settings), live_rates(other)
        for n in sorted(own, key=lambda n: (n == 0, n)):
            mine, p = own[n], pred.get(n, Rate())
            live_mine, live_theirs = own_live.get(n, Rate()), their_live.get(n, Rate())
            self_error = (
                (mine.tokens_per_s / live_mine.tokens_per_s - 1) * 100
                if mine.tokens_per_s and live_mine.tokens_per_s
                else None
            )
            rows.append([
                "all" if n == 0 else str(n), f"{name} (`{policy_label(policy)}`)",
                f"{other_name} (`{policy_label(theirs)}`)", fmt(mine.tokens_per_s, 1), fmt(p.tokens_per_s, 1),
                _ratio(mine.tokens_per_s, p.tokens_per_s),
                _ratio(live_mine.tokens_per_s, live_theirs.tokens_per_s), fmt(self_error, 1),
                "–" if p.thin_share is None else f"{100 * p.thin_share:.0f}",
            ])  # fmt: skip
    return rows


def run_logs(run_dir: str) -> tuple[str, list[str]]:
    """The logs of a ``bench=serve`` run (``run_dir/bench/results.json`` and ``run_dir/logs``): the default
    config's (kind ``default``) and the fixed and baseline configs', by the bench's file names
    (bench/serve_daemon.py ``safe_name``); a gzipped log is unpacked beside itself once. Raises
    ValueError naming what is missing."""
    root = Path(run_dir)
    results = root / "bench" / "results.json"
    if not results.is_file():
        raise ValueError(f"{results}: no results.json (unpack the run's out.tar.part_* into {root})")
    configs = json.loads(results.read_text()).get("serve", {}).get("configs", [])

    def log_of(name: str) -> str:
        path = root / "logs" / f"{safe_name(name)}.sqlite"
        packed = path.with_name(path.name + ".gz")
        if not path.is_file() and packed.is_file():
            plain_log(packed, path.parent)
        if not path.is_file():
            raise ValueError(f"{path}: the decision log of config {name!r} is missing")
        return str(path)

    served = [c for c in configs if c.get("error") is None]
    default = [c["name"] for c in served if c.get("kind") == "default"]
    if not default:
        raise ValueError(f"{results}: no config of kind default served in this run")
    return log_of(default[0]), [log_of(c["name"]) for c in served if c.get("kind") in ("fixed", "baseline")]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], prog="python -m specsched.bench.same_costs"
    )
    ap.add_argument("--replayed", help="the policy's log: its bits and costs price every policy")
    ap.add_argument("--other", action="append", default=[], help="a log whose policy to compare (repeat)")
    ap.add_argument("--run", help="an unpacked bench=serve run: its default config against its fixed rows")
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--seed", type=int, default=0, help="of the imputed match bits")
    args = ap.parse_args(argv)
    if args.run:
        if args.replayed or args.other:
            ap.error("--run picks the logs itself: give it alone")
        try:
            args.replayed, args.other = run_logs(args.run)
        except ValueError as e:
            sys.stderr.write(f"same_costs: {e}\n")
            return 2
    if not args.replayed or not args.other:
        ap.error("give --replayed and at least one --other log, or --run")
    replayed = load_log(args.replayed, seed=args.seed)
    others = [(log_name(p), load_log(p, seed=args.seed)) for p in args.other]
    try:
        rows = same_cost_rows(replayed, others, log_name(args.replayed))
    except ValueError as e:
        sys.stderr.write(f"same_costs: {e}\n")
        return 2
    text = f"Costs of `{log_name(args.replayed)}`'s daemon for every policy.\n\n{table(HEADER, rows)}\n"
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
