"""How much does carrying a plan cost? Replay a decision log under goodput deciding every step, and
under the engine's planner: a decide every ``interval`` steps (or when the batch changed too much to
carry), its plan carried in between by :func:`specsched.engine.carry.carry_plan`, decided either
ahead (every request offered ``max_k``, as ``scheduler.plan_ahead`` does) or on the step's own offers.

``python -m specsched.bench.carry_replay LOG [--intervals 1 6] [--offers ahead step] [--max-joined 0.125]
[--fixed-k 8]``

The replay is :func:`specsched.policies.replay.simulate` per concurrency level
(:mod:`specsched.policies.replay_segments`): the log's match bits decide what each draft would have
got, its refitted cost model prices each step. The replay decides every step; a live engine carries
plans, so the gap between the ``every step`` row and a carried row is what carrying costs in tokens
per request-step (the decide's own host time is not in it). On the 2026-12-06 H100 serve log of fixed
k = 8 (docs/benchmarks.md) it showed that a plan decided ahead drafts less than the offers allow at
N = 64 (scheduler.plan_ahead_max_batch) and that a plan carried by its k loses what its intent keeps
(goodput's ``k_intent``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from specsched.bench.markdown import fmt, table
from specsched.engine.carry import carry_plan
from specsched.engine.planning import MAX_JOINED
from specsched.policies.base import BatchView, Plan, Policy
from specsched.policies.registry import build_policy
from specsched.policies.replay import simulate
from specsched.policies.replay_bits import complete_bits
from specsched.policies.replay_costs import refit_costs
from specsched.policies.replay_log import load_run
from specsched.policies.replay_segments import split_levels

OFFERS = ("ahead", "step")


class CarriedPolicy:
    """``inner`` as the engine's planner runs it: a fresh decide every ``interval`` steps (or when
    :func:`carry_plan` refuses the batch: more than ``max_joined`` of it new), the plan carried in
    between. ``offer`` "ahead": the decide sees every request offered ``max_k`` (a plan decided
    during the last step's scoring) and the step runs it carried to its offers (:func:`carry_plan`,
    as the engine's planner does: the plan's intent and token budget apply); "step": the step's
    offers."""

    is_plan_ahead_safe = True

    def __init__(self, inner: Policy, interval: int, max_k: int, offer: str, max_joined: float = MAX_JOINED):
        if offer not in OFFERS:
            raise ValueError(f"offer must be one of {', '.join(OFFERS)}, got {offer!r}")
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.inner, self.interval, self.max_k, self.offer = inner, interval, max_k, offer
        self.max_joined = max_joined
        self.name = inner.name
        self.held: tuple[list[str], Plan, dict[str, int]] | None = None
        self.age = 0
        self.num_decides = 0

    def decide(self, view: BatchView, costs) -> Plan:
        if self.held is not None and self.age < self.interval:
            ids, plan, caps = self.held
            carried = carry_plan(ids, plan, view, self.max_joined, caps)
            if carried is not None:
                self.age += 1
                return carried
        seen = view
        if self.offer == "ahead":
            seen = dataclasses.replace(
                view, requests=[dataclasses.replace(r, max_k=self.max_k) for r in view.requests]
            )
        plan = self.inner.decide(seen, costs)
        self.num_decides += 1
        caps = {r.request_id: r.max_k for r in seen.requests}  # the offers the decide saw
        ids = [r.request_id for r in view.requests]
        self.held = ids, plan, caps
        self.age = 1
        if self.offer == "ahead":  # the step runs it carried to its own offers, as the engine's planner
            carried = carry_plan(ids, plan, view, self.max_joined, caps)
            if carried is not None:
                return carried
        k = [min(k, r.max_k) for k, r in zip(plan.k, view.requests, strict=True)]  # a copy: the step's own
        return dataclasses.replace(plan, k=k)

    def observe(self, plan: Plan, accepted: list[int]) -> None:
        self.inner.observe(plan, accepted)


def carry_rows(
    path: str,
    intervals: Sequence[int],
    offers: Sequence[str],
    fixed_k: int | None,
    max_joined: Sequence[float] = (MAX_JOINED,),
    decide_ms: float | None = None,
) -> list[list[str]]:
    """Per concurrency level of the log: fixed k (when given), goodput every step, goodput carried
    for each interval × offer × max_joined share; (level, config, tok/s, tokens per request-step,
    mean k, decides) and, with ``decide_ms``, the tok/s with each of goodput's decides charged that
    many ms on the step (a decide on the step; the replayed steps' ms hold the recorded policy's)."""
    run = load_run(path)
    bits = complete_bits(run, 0)
    costs = refit_costs(run)
    max_k = run.settings.max_k
    configs: list[tuple[str, object]] = []
    if fixed_k is not None:
        scorers = run.settings.scorers
        scorer = next((s for s in ("mqa_graph", "mqa") if s in scorers), scorers[0])
        cfg = {"name": "fixed", "k": fixed_k, "scorer": scorer}
        configs.append((f"fixed k={fixed_k} {scorer}", lambda: build_policy(cfg)))
    configs.append(("goodput, every step", lambda: build_policy({"name": "goodput"})))
    for i in intervals:
        for o in offers:
            for j in max_joined:
                label = f"goodput, {i} steps a plan, decided {'ahead' if o == 'ahead' else 'on the step'}"
                if len(max_joined) > 1 or j != MAX_JOINED:
                    label += f", up to {j:g} of the batch new"
                make = lambda i=i, o=o, j=j: CarriedPolicy(build_policy({"name": "goodput"}), i, max_k, o, j)  # noqa: E731
                configs.append((label, make))
    rows = []
    for level, (sub, sub_bits, _) in split_levels(run, bits).items():
        for label, make in configs:
            policy = make()
            res = simulate(sub, sub_bits, policy, costs, label, None, closed_loop=True)
            per_request = res.num_decode_tokens / res.num_request_steps if res.num_request_steps else 0.0
            is_goodput = label.startswith("goodput")
            decides = getattr(policy, "num_decides", res.num_steps)
            row = [str(level), label, fmt(res.tokens_per_s, 0), fmt(per_request, 3), fmt(res.mean_k, 2),
                   f"{decides} / {res.num_steps}"]  # fmt: skip
            if decide_ms is not None:
                ms = res.predicted_ms + (decides * decide_ms if is_goodput else 0.0)
                row.append(fmt(res.num_tokens / (ms / 1e3), 0) if ms > 0 else "–")
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="a decision log (SQLite) with match bits: bench=serve's, a daemon's")
    ap.add_argument("--intervals", type=int, nargs="+", default=[1, 6], help="steps a plan runs")
    ap.add_argument("--offers", nargs="+", choices=OFFERS, default=list(OFFERS))
    ap.add_argument("--max-joined", type=float, nargs="+", default=[MAX_JOINED],
                    help="shares of the batch that may be new in a carried plan")  # fmt: skip
    ap.add_argument("--fixed-k", type=int, default=8, help="a fixed-k row beside (0: none)")
    ap.add_argument("--decide-ms", type=float, default=None,
                    help="charge each goodput decide this many ms (a log's median decide_ms)")  # fmt: skip
    args = ap.parse_args(argv)
    if any(i < 1 for i in args.intervals):
        ap.error("every --intervals value must be >= 1")
    if any(not 0.0 <= j <= 1.0 for j in args.max_joined):
        ap.error("every --max-joined share must be in [0, 1]")
    if args.decide_ms is not None and args.decide_ms < 0:
        ap.error("--decide-ms must be >= 0")
    rows = carry_rows(
        args.log, args.intervals, args.offers, args.fixed_k or None, args.max_joined, args.decide_ms
    )
    header = ["N", "config", "tok/s (replayed)", "tokens / request-step", "mean k", "decides / steps"]
    if args.decide_ms is not None:
        header.append(f"tok/s, {args.decide_ms:g} ms a decide")
    sys.stdout.write(table(header, rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
