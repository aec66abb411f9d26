"""Do the torch calls after a goodput decide run slower? (issue 12: goodput's batch-1 steps.)

In the daemon's logs of 2026-12-05 (H100) goodput's plain decode steps on the MQA graph cost ~0.05 ms
more than fixed k = 8's plain steps, the same forward: the decide ahead itself was hidden behind the
GPU, but the next scoring launch took 0.221 vs 0.197 ms and the event records 0.075 vs 0.064 ms. One
explanation is the decide's memory traffic evicting the launch path's code and data from the engine
core's caches. This probe times a fixed chain of small torch calls (a launch path's proxy: on CUDA
each call launches a kernel; the host time is timed, the device synchronised outside the timed part)
right after a goodput decide on a random view of ``batch`` requests, and, interleaved with it, right
after a spin of the decide's length that touches no memory. The ratio of the two medians is what the
decide costs the calls that follow it.

``python -m specsched.bench.decide_cache --batches 1 16 64 [--steps 1000] [--device cuda]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from specsched.bench.markdown import fmt, table
from specsched.policies.base import BatchView, RequestView
from specsched.policies.cost_model import CostModels
from specsched.policies.fixed import FixedConfig, FixedPolicy
from specsched.policies.goodput import GoodputPolicy
from specsched.policies.sim_machine import get_machine
from specsched.policies.simulate import Scenario, simulate

SCORERS = ["batch_expansion", "mqa", "mqa_graph"]
MACHINE = "h200-smollm2-135m"  # policies/sim_machine.py: SmolLM2 on the H200, as modelled


def trained_costs(seed: int = 0) -> CostModels:
    """Cost models that learnt fixed-k steps of every scorer at batch 1, 16 and 64 on the simulator's
    SmolLM2 machine (policies/simulate.py), so that the decide's search weighs real trade-offs."""
    m = get_machine(MACHINE)
    costs = CostModels(m.graph_buckets, device=m.device)
    for batch in (1, 16, 64):
        for scorer in SCORERS:
            for k in (0, 3, 8):
                sc = Scenario(m, 0.5, batch, "ngram", num_steps=20, scorers=list(SCORERS))
                simulate(FixedPolicy(FixedConfig(k=k, scorer=scorer)), sc, seed=seed, costs=costs)
    return costs


def views(batch: int, steps: int, seed: int = 0) -> list[BatchView]:
    """Random n-gram-like views: caps 0-8, acceptance 0.1-0.8, contexts that grow."""
    rng = np.random.default_rng([seed, batch])
    acc = rng.uniform(0.1, 0.8, batch)
    ctx = rng.integers(50, 1500, batch)
    out = []
    for step in range(steps):
        caps = np.where(rng.uniform(size=batch) < 0.6, rng.integers(1, 9, batch), 0)
        reqs = [RequestView(f"r{i}", int(ctx[i]) + step, "ngram", int(caps[i]), float(acc[i]), 0.05)
                for i in range(batch)]  # fmt: skip
        out.append(BatchView(reqs, 1 << 20, 16, list(SCORERS), step))
    return out


class LaunchProxy:
    """A fixed chain of small torch calls on ``device`` (on CUDA, kernel launches)."""

    def __init__(self, device: str, calls: int = 10) -> None:
        self.device = torch.device(device)
        self.x = torch.zeros(256, device=self.device)
        self.idx = torch.arange(16, device=self.device)
        self.src = torch.ones(16, device=self.device)
        self.calls = calls

    def __call__(self) -> float:
        """Host seconds of the chain (the device synchronised after, outside the timed part)."""
        t0 = time.perf_counter()
        for _ in range(self.calls):
            y = self.x.add(1.0)
            y.index_copy_(0, self.idx, self.src)
            y[self.idx].sum()
        dt = time.perf_counter() - t0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return dt


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def probe(batch: int, steps: int, device: str, seed: int = 0) -> dict:
    """Median host µs of the decide and of the proxy after it and after a spin of its length."""
    costs, policy, proxy = trained_costs(seed), GoodputPolicy(), LaunchProxy(device)
    vs = views(batch, steps + 50, seed)
    for v in vs[:50]:  # warm: the policy's caches, the proxy's first launches
        policy.decide(v, costs)
        proxy()
    decide_s: list[float] = []
    after = {"decide": [], "spin": []}
    for i, v in enumerate(vs[50:]):
        if i % 2 == 0:
            t = time.perf_counter()
            policy.decide(v, costs)
            decide_s.append(time.perf_counter() - t)
            key = "decide"
        else:
            _spin(statistics.median(decide_s[-16:]))
            key = "spin"
        after[key].append(proxy())
    d, s = statistics.median(after["decide"]), statistics.median(after["spin"])
    return {"batch": batch, "decide_us": 1e6 * statistics.median(decide_s), "after_decide_us": 1e6 * d,
            "after_spin_us": 1e6 * s, "ratio": d / s if s > 0 else None}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=1000,
                    help="timed chains per batch size, after a decide and after a spin in turn")  # fmt: skip
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps < 2 or any(b < 1 for b in args.batches):
        ap.error("--steps must be >= 2 and every batch size >= 1")
    rows = [probe(b, args.steps, args.device, args.seed) for b in args.batches]
    header = ["batch", "decide µs", "calls after a decide µs", "after a spin µs", "after decide / after spin"]
    body = [[str(r["batch"]), fmt(r["decide_us"], 1), fmt(r["after_decide_us"], 1),
             fmt(r["after_spin_us"], 1), fmt(r["ratio"], 3)] for r in rows]  # fmt: skip
    sys.stdout.write(f"device {args.device}, {args.steps // 2} decides per batch size (medians)\n\n")
    sys.stdout.write(table(header, body) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
