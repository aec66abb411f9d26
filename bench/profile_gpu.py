"""Where a step's time goes on the GPU: kernels per forward, device busy time, host time.

For the scorer shapes of the issue's targets and for a small model's engine step this prints:
- **ms**: the step's latency (CUDA events around one call on an idle device, as the micro-benchmark);
- **kernels** and **GPU busy ms** per call, from the torch profiler (CUPTI traces the kernels inside
  graph replays too), and the top kernels by total time — the list to fuse next;
- for the engine step: the host's share (cProfile, top functions by cumulative time).

    python -m specsched.bench.profile_gpu [--parts scorers draft engine phases eager_host] [--top 12]
        [--batches 1 16 64]   (phases: host ms per step phase, fixed k vs goodput, and their profiles)

Timing/profiling only: random bf16 weights (``llama2-7b``, ``llama-68m``, ``smollm2-135m`` presets).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from specsched.bench.common import EngineSpec, blocks_for, make_engine, median, random_model, time_ms
from specsched.bench.scorers import shared_prefix_batch
from specsched.engine.config import NgramConfig
from specsched.engine.request import SamplingParams
from specsched.kernels.metadata import build_metadata
from specsched.models.cuda_graphs import GraphRunner
from specsched.models.graph_buckets import decode_buckets
from specsched.policies.fixed import FixedConfig, FixedPolicy
from specsched.proposers.ngram import NgramProposer
from specsched.proposers.none import NoProposer
from specsched.scorers.graph import GraphConfig, GraphForward
from specsched.scorers.registry import build_scorers


def kernel_profile(
    fn: Callable[[], object], calls: int = 3
) -> tuple[float, float, list[tuple[str, int, float]]]:
    """(kernels per call, GPU busy ms per call, [(kernel, count per call, ms per call)]) of ``fn``
    (the list sorted by time)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_name[ev.name].append(ev.device_time / 1e3)  # us -> ms
    n = sum(map(len, by_name.values())) / calls
    busy = sum(map(sum, by_name.values())) / calls
    top = sorted(((k[:90], round(len(v) / calls), sum(v) / calls) for k, v in by_name.items()),
                 key=lambda r: -r[2])  # fmt: skip
    return n, busy, top


def print_profile(label: str, ms: float, prof: tuple[float, float, list], top: int) -> None:
    n, busy, rows = prof
    print(f"\n## {label}: {ms:.3f} ms per call; {n:.0f} kernels, GPU busy {busy:.3f} ms")
    for name, count, kms in rows[:top]:
        print(f"  {kms:8.3f} ms  x{count:<5d} {name}")


def profile_scorers(top: int) -> None:
    model = random_model("llama2-7b", torch.device("cuda"), torch.bfloat16)
    bs, max_b, max_k, max_ctx = 16, 64, 5, 2048
    shared = (max_ctx - 1) // bs
    num_blocks = 1 + shared + max_b * (-(-(max_ctx + max_k) // bs) - shared + 1)
    kv = model.allocate_kv_cache(num_blocks, bs)
    gcfg = GraphConfig(enabled=True, max_batch=max_b, max_k=max_k, max_model_len=max_ctx + max_k + 1)
    scorers = build_scorers(["batch_expansion", "mqa", "mqa_graph"], model, kv, bs, gcfg)
    for b, k, c in [(1, 3, 550), (64, 3, 2048)]:
        reqs, props, _ = shared_prefix_batch(b, k, c, bs, 1, model.cfg.vocab_size, 0, "cuda")
        for name, scorer in scorers.items():
            step = lambda s=scorer, r=reqs, p=props: s.score(r, p)  # noqa: E731
            ms = median(time_ms(step, torch.device("cuda"), 2, 7))
            print_profile(f"llama2-7b {name} batch {b} k {k} ctx {c}", ms, kernel_profile(step), top)
    del scorers, kv, model
    torch.cuda.empty_cache()


def profile_draft(top: int) -> None:
    model = random_model("llama-68m", torch.device("cuda"), torch.bfloat16)
    bs, ctx = 16, 512
    blocks_per = -(-(ctx + 1) // bs)
    kv = model.allocate_kv_cache(1 + blocks_per, bs)
    runner = GraphRunner(model, kv, decode_buckets(1), blocks_per, progress=False, name="draft")
    fwd = GraphForward(runner)
    meta = build_metadata([1], [ctx], [list(range(1, 1 + blocks_per))], bs, torch.device("cuda"))
    ids = torch.full((1,), 3, dtype=torch.int64, device="cuda")
    pos = torch.full((1,), ctx - 1, dtype=torch.int64, device="cuda")
    last = torch.arange(1, device="cuda")
    with torch.inference_mode():
        step = lambda: fwd(ids, pos, meta, kv, last)  # noqa: E731
        ms = median(time_ms(step, torch.device("cuda"), 3, 20))
        print_profile("llama-68m draft step, batch 1 (GraphForward)", ms, kernel_profile(step), top)
        t0 = time.perf_counter()
        for _ in range(100):
            step()
        host = (time.perf_counter() - t0) * 10  # ms per call, host side (launches queue asynchronously)
        torch.cuda.synchronize()
        print(f"  host time per GraphForward call (100 calls, no sync): {host:.3f} ms")


def profile_engine(top: int, tokens: int) -> None:
    from specsched.engine.config import ModelConfig
    from specsched.models.loader import load_model

    loaded = load_model(ModelConfig(source="smollm2-135m", device="cuda", dtype="bfloat16"))
    model, bs, max_len, max_k = loaded.model, 16, 512, 8
    num_blocks = blocks_for(1, max_len, bs)
    kv = model.allocate_kv_cache(num_blocks, bs)
    gcfg = GraphConfig(enabled=True, max_batch=4, max_k=max_k, max_model_len=max_len)
    scorers = build_scorers(["batch_expansion", "mqa_graph"], model, kv, bs, gcfg)
    spec = EngineSpec(model, kv, num_blocks, bs, scorers, 4, max_k, max_len, [2], None, "smollm2-135m")
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12] * 8]
    for label, k, proposer in [("non-spec", 0, "none"), ("ngram fixed k=3 mqa_graph", 3, "ngram")]:
        props = {
            "none": NoProposer(torch.device("cuda")),
            "ngram": NgramProposer(NgramConfig(), torch.device("cuda")),
        }
        policy = FixedPolicy(FixedConfig(k=k, scorer="mqa_graph" if k else "batch_expansion"))
        engine = make_engine(spec, props, proposer, policy)
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        steps: list[float] = []
        engine.on_step = lambda rec, s=steps: s.append(time.perf_counter())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.generate(prompt, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        print(f"\n## engine smollm2-135m (random) batch 1 {label}: {len(out[0]) / wall:.1f} tok/s, "
              f"{len(steps)} steps, median step {median(gaps) * 1e3:.3f} ms")  # fmt: skip
        short = SamplingParams(max_tokens=16, ignore_eos=True)
        prof = kernel_profile(lambda e=engine, p=short: e.generate(prompt, p), 1)
        print_profile(f"{label}: one 16-token generate", float("nan"), prof, top)
        pr = cProfile.Profile()
        pr.enable()
        engine.generate(prompt, params)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(top + 10)
        print("\n".join(s.getvalue().splitlines()[: top + 20]))


def profile_eager_host(top: int) -> None:
    """Where the eager MQA scorer's host time goes (issue 17: 3.6x the floor at llama2-7b shapes,
    batch 1, k 3, ctx 550, against ~1.4x in a graph), eager and on piecewise graphs
    (``model.piecewise_graphs``): host ms per ``score`` call without a sync (the launches queue ahead
    of the GPU only while the host is slower) and wall ms, then a cProfile of 20 calls, top functions
    by own time: our wrappers' Python, Triton's launcher, torch's dispatch."""
    model = random_model("llama2-7b", torch.device("cuda"), torch.bfloat16)
    bs, ctx, k = 16, 550, 3
    kv = model.allocate_kv_cache(4 + -(-(ctx + k + 1) // bs), bs)
    reqs, props, _ = shared_prefix_batch(1, k, ctx, bs, 1, model.cfg.vocab_size, 0, "cuda")
    pw_cfg = GraphConfig(max_batch=1, max_k=k, max_model_len=ctx + k + 1, progress=False, piecewise=True)
    for label, gcfg in [("eager mqa", GraphConfig(enabled=False)), ("mqa on piecewise graphs", pw_cfg)]:
        scorer = build_scorers(["mqa"], model, kv, bs, gcfg)["mqa"]  # built in turn: eager first
        step = lambda s=scorer: s.score(reqs, props)  # noqa: E731
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        host = (time.perf_counter() - t0) * 1e3 / 20
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / 20
        print(f"\n## {label}, llama2-7b batch 1 k {k} ctx {ctx}: host {host:.3f} ms a call, wall {wall:.3f}")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            step()
        pr.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
        print("\n".join(out.getvalue().splitlines()[: top + 12]))


ALL_SCORERS = ["batch_expansion", "mqa", "mqa_graph"]
PHASE_CONFIGS = {  # label: (scorers, policy, scheduler overrides)
    "fixed k=5 mqa_graph [mqa_graph]": (["mqa_graph"], {"name": "fixed", "k": 5, "scorer": "mqa_graph"}, {}),
    "fixed k=5 mqa_graph [all]": (ALL_SCORERS, {"name": "fixed", "k": 5, "scorer": "mqa_graph"}, {}),
    "goodput [all]": (ALL_SCORERS, {"name": "goodput"}, {}),
    "goodput [all], no plan-ahead": (ALL_SCORERS, {"name": "goodput"}, {"plan_ahead": "off"}),
    "goodput [all], decide rarely": (ALL_SCORERS, {"name": "goodput"}, {"decide_budget": 1e-3,
                                                                       "max_plan_age": 16,
                                                                       "decide_cost": "host"}),
}  # fmt: skip


def phase_prompts(batch: int, seed: int = 0) -> list[list[int]]:
    """Random text with a repeated motif at its end: n-gram matches, not a random model's echo alone."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        motif = [rng.randrange(3, 2000) for _ in range(rng.randint(3, 12))]
        out.append([rng.randrange(3, 2000) for _ in range(40)] + (motif * 20)[:60])
    return out


def profile_phases(top: int, tokens: int, batches: list[int], only: list[str] | None = None) -> None:
    """The engine's host time per phase on CUDA (``StepRecord.host_ms``, medians over the decode
    steps at the full batch) for a fixed k on one scorer, the same with every scorer built, and
    goodput (as on the daemon, without plan-ahead, and deciding at most every 16 steps: which of its
    host time the decide causes); SmolLM2's shape, random bf16 weights, n-gram, plan-ahead as on the
    daemon (auto). Then a cProfile of each config's decode loop at the largest batch (a second
    generate, top functions by own time; ``--top 0``: none): which
    host work one config does that another does not (H200, 2026-12-04: goodput's score phase
    0.06-0.3 ms longer than fixed k=5's, not seen on the CPU)."""
    import statistics

    from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
    from specsched.engine.engine import Engine

    for batch in batches:
        for label, (scorers, policy, sched) in PHASE_CONFIGS.items():
            if only and label not in only:
                continue
            cfg = EngineConfig(
                model=ModelConfig(source="smollm2-135m", device="cuda", dtype="bfloat16", max_model_len=2048),
                cache=CacheConfig(block_size=16, num_blocks=8192),
                scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=4096, **sched),
                spec=SpecConfig(proposer="ngram", scorers=scorers, max_k=8),
                policy=policy,
            )  # fmt: skip
            engine = Engine.from_config(cfg)
            prompts = phase_prompts(batch)
            engine.generate(prompts[:2], SamplingParams(max_tokens=16, ignore_eos=True))  # warm-up
            recs: list = []

            def keep(r, b=batch, out=recs) -> None:
                if r.kind == "decode" and r.batch_size == b:
                    out.append(r)

            engine.on_step = keep
            engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
            pr = None
            if top > 0 and batch == max(batches):  # profiled apart: cProfile slows every Python call
                engine.on_step = None
                pr = cProfile.Profile()
                pr.enable()
                engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
                pr.disable()
            phases: dict[str, list[float]] = defaultdict(list)
            for r in recs:
                for k, v in r.host_ms.items():
                    phases[k].append(v)
            ks = [q.k for r in recs for q in r.requests] or [0]
            step_ms = median([r.total_ms for r in recs]) if recs else float("nan")
            gpu_ms = median([r.score_ms for r in recs]) if recs else float("nan")
            tok = statistics.fmean(r.num_tokens for r in recs) if recs else float("nan")
            mean_k = statistics.fmean(ks)
            print(f"\n## phases, batch {batch}, {label}: {len(recs)} steps, step ms {step_ms:.3f}, "
                  f"score GPU ms {gpu_ms:.3f}, tokens {tok:.1f}, mean k {mean_k:.2f}")  # fmt: skip
            print("   host ms: " + ", ".join(f"{k} {median(v):.3f}" for k, v in sorted(phases.items())))
            if pr is not None:
                out = io.StringIO()
                pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
                print("\n".join(out.getvalue().splitlines()[: top + 12]))
            del engine
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["scorers", "draft", "engine"])
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="batches of --parts phases")
    ap.add_argument("--configs", nargs="+", choices=list(PHASE_CONFIGS), help="--parts phases: these only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_gpu needs a CUDA device")
    print(torch.cuda.get_device_name(), torch.__version__)
    with torch.inference_mode():
        if "draft" in args.parts:
            profile_draft(args.top)
        if "engine" in args.parts:
            profile_engine(args.top, args.tokens)
        if "scorers" in args.parts:
            profile_scorers(args.top)
        if "eager_host" in args.parts:
            profile_eager_host(args.top)
        if "phases" in args.parts:
            profile_phases(args.top, args.tokens, args.batches, args.configs)


if __name__ == "__main__":
    main()
