"""Where a step's time goes on the GPU: kernels per forward, device busy time, host time.

For the scorer shapes of the issue's targets and for a small model's engine step this prints:
- **ms**: the step's latency (CUDA events around one call on an idle device, as the micro-benchmark);
- **kernels** and **GPU busy ms** per call, from the torch profiler (CUPTI traces the kernels inside
  graph replays too), and the top kernels by total time — the list to fuse next;
- for the engine step: the host's share (cProfile, top functions by cumulative time).

    python -m specsched.bench.profile_gpu [--parts scorers draft engine] [--top 12]

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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["scorers", "draft", "engine"])
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
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


if __name__ == "__main__":
    main()
