"""Host ms of the n-gram proposer's peek per decode step, in the CUDA step's order (issue 17's host line).

On CUDA the engine hands the proposer each step's requests while the GPU scores (``on_scoring``: the
n-grams ending at the tokens known before the commit are indexed there, off the critical path); the
step then commits 1..k+1 tokens per request, and the next step's ``peek`` (on the critical path,
before the decide) finds each request's match over its grown tokens. This times both on synthetic
token streams with the repeats of chat answers: each request's prompt and output draw half their
tokens from a small per-request pool (n-gram matches, as in copy-heavy answers), half from the whole
vocabulary; a step commits 1-9 tokens per request.

    python -m specsched.bench.ngram_peek [--batches 1 16 64] [--steps 200] [--repeat 3] [--seed 0]

On the dev CPU (2026-12-07): peek 0.59 ms a step at batch 64 when it indexed the committed tokens
itself, 0.26 ms since it compares them with the suffix directly (proposers/ngram.py NgramIndex.match).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from specsched.bench.markdown import fmt, table
from specsched.engine.config import NgramConfig
from specsched.engine.request import Request, SamplingParams
from specsched.proposers.ngram import NgramProposer

VOCAB = 49152  # SmolLM2's


def _tokens(rng: random.Random, pool: list[int], n: int) -> list[int]:
    return [rng.choice(pool) if rng.random() < 0.5 else rng.randrange(VOCAB) for _ in range(n)]


def measure(batch: int, steps: int, seed: int) -> dict:
    """One run: ``batch`` requests of 100-600 prompt tokens, ``steps`` steps; ms per step (medians)."""
    rng = random.Random(seed)
    prop = NgramProposer(NgramConfig(min_n=1, max_n=4))
    pools = [[rng.randrange(VOCAB) for _ in range(60)] for _ in range(batch)]
    prompts = [_tokens(rng, pools[i], rng.randrange(100, 600)) for i in range(batch)]
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=10**6)) for i, p in enumerate(prompts)]
    prop.on_prefill(reqs)
    peek_ms, scoring_ms, caps = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        prop.on_scoring(reqs)  # while the GPU scores
        t1 = time.perf_counter()
        for i, r in enumerate(reqs):  # the commit
            r.output_ids.extend(_tokens(rng, pools[i], rng.randint(1, 9)))
        t2 = time.perf_counter()
        peek = prop.peek(reqs)  # the next step's, on the critical path
        t3 = time.perf_counter()
        scoring_ms.append((t1 - t0) * 1e3)
        peek_ms.append((t3 - t2) * 1e3)
        caps.append(sum(peek.max_k) / batch)
    return {"batch": batch, "peek_ms": statistics.median(peek_ms),
            "on_scoring_ms": statistics.median(scoring_ms), "mean_cap": statistics.mean(caps)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3, help="runs per batch; the table gives the least")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = []
    for b in args.batches:
        runs = [measure(b, args.steps, args.seed + r) for r in range(args.repeat)]
        best = min(runs, key=lambda x: x["peek_ms"])
        rows.append([str(b), fmt(best["peek_ms"], 3), fmt(best["on_scoring_ms"], 3), fmt(best["mean_cap"], 1),
                     " / ".join(fmt(x["peek_ms"], 3) for x in runs)])  # fmt: skip
    print(table(["batch", "peek ms (critical path)", "on_scoring ms (while the GPU scores)",
                 "mean offer (tokens)", "peek ms of each run"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
