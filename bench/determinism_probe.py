"""Where speculative output leaves non-speculative output (issue 16: deterministic mode).

Runs the non-speculative baseline once, then a speculative engine under each given policy (``reps``
generates each: a policy that learns, like goodput, chooses differently every time), and for every
request whose greedy output differs reports the first differing output index and the decode step
that emitted it (its scorer, batch, tokens, the request's k, accepted drafts, the token's offset in
the step) with the request's steps before it. Found with it on the H200 (2026-12-04): SmolLM2
prompt 24 alone, fixed k = 8 on either MQA scorer, diverges at output 50 in deterministic bf16.

    python -m specsched.bench.determinism_probe [--source smollm2] [--device cuda]
        [--policy goodput fixed:8:mqa_graph random:0 ...] [--reps 2] [--prompts 24 ...]
        [--max-tokens 128] [--max-model-len 2048] [--plan-ahead auto|on|off] [--not-deterministic]

Policies: ``goodput``, ``hf_heuristic``, ``fixed:K:SCORER``, ``random:SEED`` (a random k in 0..8 per
request and a random scorer every step). Prompts: the 64 chat prompts of :func:`chat_grid` (indices
with ``--prompts``); token-id motifs with ``--ids`` (models without a tokenizer).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specsched.bench.prompts import chat_grid
from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.records import StepRecord
from specsched.engine.request import SamplingParams
from specsched.policies.base import BatchView, Plan, Policy

SCORERS = ["batch_expansion", "mqa", "mqa_graph"]
BASELINE = {"name": "fixed", "k": 0, "scorer": "batch_expansion"}  # the non-speculative engine's policy
POLICIES = ["goodput", "fixed:8:mqa_graph", "fixed:8:mqa", "random:0"]


class RandomPlan(Policy):
    """A random k in [0, the request's max_k] per request and a random scorer every step."""

    name = "random_plan"

    def __init__(self, scorers: list[str], seed: int = 0) -> None:
        self.scorers, self.rng = scorers, random.Random(seed)

    def decide(self, view: BatchView, costs) -> Plan:
        return Plan(
            [self.rng.randint(0, r.max_k) for r in view.requests], self.rng.choice(self.scorers), self.name
        )


def policy_of(spec: str, scorers: list[str]) -> dict | Policy:
    """``goodput`` | ``hf_heuristic`` | ``fixed:K:SCORER`` | ``random:SEED``."""
    name, *args = spec.split(":")
    if name == "fixed" and len(args) == 2:
        return {"name": "fixed", "k": int(args[0]), "scorer": args[1]}
    if name == "random" and len(args) <= 1:
        return RandomPlan(scorers, int(args[0]) if args else 0)
    if not args:
        return {"name": name}
    raise ValueError(f"policy {spec!r}: expected goodput, hf_heuristic, fixed:K:SCORER or random:SEED")


def first_divergence(got: Sequence[int], want: Sequence[int]) -> int | None:
    """The first output index where the two differ (the shorter one's length when one is a prefix
    of the other), None when equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


@dataclass
class StepAt:
    """A decode step of one request: the step's record and the request's row in it."""

    step: int
    scorer: str | None
    batch_size: int
    num_tokens: int
    context_len: int
    k: int
    num_accepted: int
    first_output: int  # the output index of the first token the step emitted for the request
    plan_info: dict = field(default_factory=dict)

    def line(self) -> str:
        return (f"step {self.step}: {self.scorer}, batch {self.batch_size}, {self.num_tokens} tokens, "
                f"ctx {self.context_len}, k {self.k}, accepted {self.num_accepted}")  # fmt: skip


def request_steps(records: Sequence[StepRecord], request_id: str, prompt_len: int) -> list[StepAt]:
    """The decode steps of ``request_id`` in ``records``, in order."""
    out = []
    for rec in records:
        if rec.kind != "decode":
            continue
        for q in rec.requests:
            if q.request_id == request_id:
                first = q.context_len + 1 - prompt_len
                out.append(StepAt(rec.step, rec.scorer, rec.batch_size, rec.num_tokens, q.context_len, q.k,
                                  q.num_accepted, first, dict(rec.plan_info)))  # fmt: skip
    return out


def emitting_step(steps: Sequence[StepAt], index: int) -> int | None:
    """The position in ``steps`` of the step that emitted output ``index`` (None: the prefill's)."""
    for i, s in enumerate(steps):
        if s.first_output <= index <= s.first_output + s.num_accepted:
            return i
    return None


def divergence_report(
    records: Sequence[StepRecord], ids: Sequence[str], prompts: Sequence[Sequence[int]],
    got: Sequence[Sequence[int]], want: Sequence[Sequence[int]], limit: int = 3,
) -> list[str]:  # fmt: skip
    """Lines for the first ``limit`` divergent requests: where, which step, the steps before it."""
    lines = []
    bad = [i for i in range(len(want)) if got[i] != want[i]]
    for i in bad[:limit]:
        d = first_divergence(got[i], want[i])
        lines.append(f"  prompt {i}: first difference at output {d}: got {list(got[i][d : d + 3])}, "
                     f"want {list(want[i][d : d + 3])}")  # fmt: skip
        steps = request_steps(records, ids[i], len(prompts[i]))
        at = emitting_step(steps, d)
        if at is None:
            lines.append("    emitted by the prefill (the first token), or by no recorded step")
            continue
        s = steps[at]
        lines.append(f"    emitted by {s.line()}, offset {d - s.first_output} in the step")
        lines += [f"    before: {b.line()}" for b in steps[max(0, at - 3) : at]]
    return lines


def make_engine(args: argparse.Namespace, proposer: str, scorers: list[str], policy: dict | Policy) -> Engine:
    cfg = EngineConfig(
        model=ModelConfig(source=args.source, dtype=args.dtype, device=args.device,
                          deterministic=not args.not_deterministic, max_model_len=args.max_model_len),
        cache=CacheConfig(block_size=16, num_blocks=args.num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, plan_ahead=args.plan_ahead),
        spec=SpecConfig(proposer=proposer, scorers=scorers, max_k=8),
        policy=policy if isinstance(policy, dict) else {"name": "fixed", "k": 0, "scorer": scorers[0]},
    )  # fmt: skip
    engine = Engine(cfg)
    if not isinstance(policy, dict):
        engine.policy = policy
    return engine


def motif_prompts(num: int = 8, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of repeated motifs (the n-gram proposer drafts on them; no tokenizer)."""
    rng = random.Random(seed)
    motifs = ([rng.randrange(3, 200) for _ in range(rng.randint(3, 9))] for _ in range(num))
    return [(m * 30)[:40] for m in motifs]


def probe(args: argparse.Namespace) -> list[str]:
    """The report's lines (also printed as they come)."""
    params = SamplingParams(max_tokens=args.max_tokens)
    base = make_engine(
        args, "none", ["batch_expansion"], {"name": "fixed", "k": 0, "scorer": "batch_expansion"}
    )
    if args.ids:
        prompts = motif_prompts()
    else:
        prompts = [base.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in chat_grid()]
    if args.prompts:
        prompts = [prompts[i] for i in args.prompts]
    want = base.generate(prompts, params)
    del base
    out: list[str] = []

    def say(line: str) -> None:
        out.append(line)
        print(line, flush=True)

    for spec in args.policy:
        engine = make_engine(args, "ngram", args.scorers, policy_of(spec, args.scorers))
        for rep in range(args.reps):
            records: list[StepRecord] = []
            engine.on_step = records.append
            first = engine.num_steps
            t0 = time.perf_counter()
            got = engine.generate(prompts, params)
            wall = time.perf_counter() - t0
            ids = [f"generate-{first}-{i}" for i in range(len(prompts))]  # Engine.generate's request ids
            same = sum(a == b for a, b in zip(got, want))
            mix: dict[str, int] = {}
            for r in records:
                if r.kind == "decode":
                    mix[r.scorer] = mix.get(r.scorer, 0) + 1
            say(f"{spec} rep {rep}: {same}/{len(want)} equal to non-speculative, {len(records)} steps, "
                f"{wall:.2f} s, decode steps by scorer {mix}")  # fmt: skip
            for line in divergence_report(records, ids, prompts, got, want):
                say(line)
        del engine
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="smollm2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--policy", nargs="+", default=["goodput", "fixed:8:mqa_graph", "fixed:8:mqa", "random:0"]
    )
    ap.add_argument("--scorers", nargs="+", default=SCORERS)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompts", type=int, nargs="*", default=None, help="indices into the 64 chat prompts")
    ap.add_argument("--ids", action="store_true", help="token-id motif prompts (no tokenizer needed)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-blocks", type=int, default=8192)
    ap.add_argument("--plan-ahead", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--not-deterministic", action="store_true", help="model.deterministic=false")
    args = ap.parse_args(argv)
    probe(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
