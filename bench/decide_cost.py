"""The goodput policy's decide, host time per batch size, against a variant of its config (CPU).

A decide ahead runs in the window while the GPU scores the step; at N = 4 on the H200 (2026-12-06 22:19
log) it took 0.66 ms (median) of a ~1 ms window and overran it. This times ``GoodputPolicy.decide``
on the same random n-gram-like views (bench/decide_cache.py ``views``: caps 0-8, acceptance 0.1-0.8)
and cost models trained on the simulator's SmolLM2 machine, for the defaults and for each variant
given as ``key=value`` overrides of :class:`~specsched.policies.goodput.GoodputConfig`, the configs
interleaved view by view (a slow stretch of the machine hits all alike). Thread CPU time, median and
p90 over the timed views, after 100 warm-up views. Plans are compared too: a variant that should
decide alike (e.g. ``plain_search_max_batch=1``, the numpy search) must give the same plans.

``python -m specsched.bench.decide_cost [--batches 2 4 7 8 16 64] [--views 600]
[--variant plain_search_max_batch=1] [--estimator --variant staged_acceptance=false]``
(``--estimator``: the views carry an acceptance estimator, which two acceptance rates — goodput's
default — need; without it every config plans with one rate.)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from specsched.bench.decide_cache import trained_costs, views
from specsched.bench.markdown import fmt, table
from specsched.policies.acceptance import AcceptanceEstimator
from specsched.policies.acceptance_stages import stages_of
from specsched.policies.base import BatchView
from specsched.policies.goodput import GoodputConfig, GoodputPolicy

WARMUP_VIEWS = 100


def parse_variant(text: str) -> dict:
    """``key=value[,key=value]`` of GoodputConfig fields, values parsed as the field's type."""
    fields = {f.name: f for f in dataclasses.fields(GoodputConfig)}
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(
                f"variant {text!r}: {key!r} is not key=value of a goodput option ({', '.join(fields)})"
            )
        default = getattr(GoodputConfig(), key)
        if isinstance(default, bool):
            out[key] = value.lower() in ("1", "true", "yes")
        elif isinstance(default, int):
            out[key] = int(value)
        elif isinstance(default, float):
            out[key] = float(value)
        else:
            raise ValueError(f"variant {text!r}: {key} is not a number or a flag")
    return out


def with_estimator(vs: list[BatchView], seed: int = 0) -> list[BatchView]:
    """The views with an acceptance estimator (both stages: ``staged_acceptance`` reads them) fed 20
    span-like steps per request (of 8 drafts none accepted, 3, or all), so that variants with two
    acceptance rates search with them."""
    rng = np.random.default_rng([seed, 7])
    est = AcceptanceEstimator()
    stages_of(est)
    for r in vs[0].requests:
        for _ in range(20):
            est.observe(r.request_id, r.proposer, 8, int(rng.choice([0, 0, 3, 8])))
    return [replace(v, acceptance=est) for v in vs]


def time_decides(
    batch: int, variants: list[dict], num_views: int, seed: int = 0, is_estimated: bool = False
) -> list[dict]:
    """Per config (the defaults first, then ``variants``): median and p90 µs of a decide, and how
    many of its plans differ from the defaults' on the same views (``is_estimated``: views that carry
    an acceptance estimator, :func:`with_estimator`)."""
    costs = trained_costs(seed)
    configs = [{}, *variants]
    policies = [GoodputPolicy(GoodputConfig(**v)) for v in configs]
    vs = views(batch, num_views + WARMUP_VIEWS, seed)
    if is_estimated:
        vs = with_estimator(vs, seed)
    times: list[list[float]] = [[] for _ in configs]
    num_differ = [0] * len(configs)
    for i, v in enumerate(vs):
        plans = []
        for j, policy in enumerate(policies):
            t = time.thread_time()
            plan = policy.decide(v, costs)
            dt = time.thread_time() - t
            plans.append((plan.k, plan.scorer))
            if i >= WARMUP_VIEWS:
                times[j].append(dt)
        num_differ = [n + (p != plans[0]) for n, p in zip(num_differ, plans)]
    rows = []
    for cfg, ts, differ in zip(configs, times, num_differ):
        ts.sort()
        rows.append({"batch": batch, "config": ",".join(f"{k}={v}" for k, v in cfg.items()) or "defaults",
                     "median_us": 1e6 * statistics.median(ts), "p90_us": 1e6 * ts[int(0.9 * (len(ts) - 1))],
                     "plans_differ": differ})  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 4, 7, 8, 16, 64])
    ap.add_argument("--views", type=int, default=600, help="timed decides per batch size and config")
    ap.add_argument(
        "--variant", action="append", default=[], help="key=value[,key=value] of goodput's options"
    )
    ap.add_argument(
        "--estimator", action="store_true", help="views with a fed acceptance estimator (two rates need it)"
    )
    args = ap.parse_args(argv)
    if args.views < 1 or any(b < 1 for b in args.batches):
        ap.error("--views and every batch size must be >= 1")
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        ap.error(str(e))
    rows = [
        r for b in args.batches for r in time_decides(b, variants, args.views, is_estimated=args.estimator)
    ]
    header = ["batch", "config", "decide µs (median)", "p90", "/ defaults", "plans unlike the defaults'"]
    base = {r["batch"]: r["median_us"] for r in rows if r["config"] == "defaults"}
    body = [[str(r["batch"]), r["config"], fmt(r["median_us"], 1), fmt(r["p90_us"], 1),
             fmt(r["median_us"] / base[r["batch"]], 2), str(r["plans_differ"])] for r in rows]  # fmt: skip
    sys.stdout.write(f"goodput decide, thread CPU time, {args.views} views per batch size\n\n")
    sys.stdout.write(table(header, body) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
