"""What ``model.fused_linear`` buys on the GPU: fused vs unfused decoder layers and forwards as CUDA
graph replays, at the decode/verify row counts it serves (M = 1..16).

    python -m specsched.bench.fused_linear [--models smollm2 7b] [--rows 1 2 4 8 16]
        [--repeats 5] [--replays 200] [--ctx 512] [--parts layer forward gemm] [--no-profile]

CUDA only (exits 2 with a message elsewhere). Random bf16 weights in SmolLM2-135M's shape (30 layers,
hidden 576, intermediate 1536, 9 / 3 heads) and Llama-2-7B's (32 layers, hidden 4096, intermediate
11008, 32 heads). Each of M rows decodes one token over ``--ctx`` cached tokens. Prints markdown:

- ``layer``: one decoder layer (``LlamaDecoderLayer.forward`` vs ``forward_fused``, and
  ``forward_fused`` with the output / down projections in ``small_linear``: ``model.fused_linear_gemms``)
  captured in a graph;
- ``forward``: the whole model (embedding to logits, the LM head fused with the final norm), the same
  three variants;
- ``gemm``: each fused GEMM alone (norm + linear, norm + gate/up + SwiGLU; ``small_linear`` for the
  output and down projections) against its unfused pair, with the default launch config and a few
  others (``FusedLinearConfig``): the data to tune ``fused_linear_config``.

Times are us per graph replay: the median over ``--repeats`` timed runs of ``--replays`` back-to-back
replays each, with the runs' min-max; fused and unfused runs alternate. ``kernels`` counts the kernels
of one replay (torch.profiler; CUPTI sees inside graphs; "-" when the profiler cannot).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace

import torch

MODELS = {"smollm2": "smollm2-135m", "7b": "llama2-7b"}
BLOCK = 16
VARIANTS = ("unfused", "fused", "gemms")  # gemms: fused, with the output / down projections in small_linear


def graph_of(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` captured (after two eager runs on a side stream: compiles, cuBLAS workspaces)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def time_run(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """us per replay over ``replays`` back-to-back replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def compare(graphs: dict[str, torch.cuda.CUDAGraph], repeats: int, replays: int) -> dict[str, list[float]]:
    """Each graph's timed runs, interleaved (run r of every graph before run r + 1 of any)."""
    for g in graphs.values():
        time_run(g, max(1, replays // 10))  # warm clocks and caches
    runs: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(repeats):
        for name, g in graphs.items():
            runs[name].append(time_run(g, replays))
    return runs


def kernels_per_replay(graph: torch.cuda.CUDAGraph) -> int | None:
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        n = sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)
        return n or None
    except Exception:  # no CUPTI, or another profiler API: the count is optional
        return None


def fmt_runs(runs: list[float]) -> str:
    return f"{statistics.median(runs):.1f} ({min(runs):.1f}-{max(runs):.1f})"


def fmt_count(n: int | None) -> str:
    return "-" if n is None else str(n)


def decode_batch(model, m: int, ctx: int):
    """(ids [m], positions [m], metadata, KV cache): m rows decoding their token ``ctx`` - 1."""
    from specsched.kernels.metadata import build_metadata

    per_row = -(-ctx // BLOCK)
    kv = model.allocate_kv_cache(1 + m * per_row, BLOCK)
    tables = [list(range(1 + i * per_row, 1 + (i + 1) * per_row)) for i in range(m)]
    meta = build_metadata([1] * m, [ctx] * m, tables, BLOCK, torch.device("cuda"))
    ids = torch.randint(0, model.cfg.vocab_size, (m,), device="cuda")
    pos = torch.full((m,), ctx - 1, dtype=torch.int64, device="cuda")
    return ids, pos, meta, kv


def bench_model(key: str, args, out: dict[str, list[list[str]]]) -> None:
    from specsched.bench.common import random_model
    from specsched.kernels.fused_linear import FUSED_MAX_ROWS

    model = random_model(MODELS[key], torch.device("cuda"), torch.bfloat16, is_decisive=False)
    for m in args.rows:
        if m > FUSED_MAX_ROWS:
            print(f"skipping M = {m}: the model fuses forwards of at most {FUSED_MAX_ROWS} rows")
            continue
        with torch.inference_mode():
            bench_rows(key, model, m, args, out)
        torch.cuda.empty_cache()


def bench_rows(key: str, model, m: int, args, out: dict[str, list[list[str]]]) -> None:
    """The layer and forward rows of ``model`` at M = ``m`` (graphs freed on return)."""
    ids, pos, meta, kv = decode_batch(model, m, args.ctx)
    hidden, layer = model.cfg.hidden_size, model.model.layers[0]
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, hidden, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(m, hidden, device="cuda", generator=gen).bfloat16()
    freqs = pos.float()[:, None] * model.inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    layer_args = (x, residual, cos, sin, kv[0], meta, model.attn)
    if "layer" in args.parts:
        graphs = {"unfused": graph_of(lambda: layer(*layer_args)),
                  "fused": graph_of(lambda: layer.forward_fused(*layer_args))}  # fmt: skip
        own = (layer.self_attn.o_proj, layer.mlp.down_proj)
        for mod in own:
            mod.is_small_m = True
        graphs["gemms"] = graph_of(lambda: layer.forward_fused(*layer_args))  # o_proj, down: small_linear
        for mod in own:
            mod.is_small_m = False
        _emit(out, "layer", row(key, m, graphs, args))
    if "forward" in args.parts:
        graphs, logits = {}, {}
        for name in VARIANTS:
            model.set_fused_linear(name != "unfused", gemms=name == "gemms")
            graphs[name] = graph_of(lambda n=name: logits.__setitem__(n, model(ids, pos, meta, kv)))
        model.set_fused_linear(False)
        for g in graphs.values():
            g.replay()
        a = logits["unfused"].float()
        diffs = [f"{float((logits[n].float() - a).norm() / a.norm()):.1e}" for n in VARIANTS[1:]]
        _emit(out, "forward", row(key, m, graphs, args) + diffs)
    if "gemm" in args.parts:
        for r in gemm_rows(key, model, m, args):
            _emit(out, "gemm", r)


def _emit(out: dict[str, list[list[str]]], part: str, cells: list[str]) -> None:
    """Keep a row for the tables and print it at once: a run stopped at its time limit keeps its rows."""
    out[part].append(cells)
    print(f"{part}: | " + " | ".join(cells) + " |", flush=True)


def row(key: str, m: int, graphs: dict[str, torch.cuda.CUDAGraph], args) -> list[str]:
    """The cells of one layer / forward row: each variant's us, its ratio to unfused, kernel counts."""
    runs = compare(graphs, args.repeats, args.replays)
    base = statistics.median(runs["unfused"])
    ratios = [f"{statistics.median(runs[n]) / base:.2f}" for n in VARIANTS[1:]]
    counts = [fmt_count(None if args.no_profile else kernels_per_replay(graphs[n])) for n in VARIANTS]
    return [key, str(m), *(fmt_runs(runs[n]) for n in VARIANTS), *ratios, *counts]


def gemm_rows(key: str, model, m: int, args) -> list[list[str]]:
    """Each fused GEMM of layer 0 (and the LM head) against its unfused pair, over a few configs. The
    SwiGLU row is norm + gate/up + SiLU-mul (N = the intermediate size)."""
    import torch.nn.functional as F

    from specsched.kernels.activation import silu_and_mul
    from specsched.kernels.fused_linear import (
        FusedLinearConfig,
        fused_linear_config,
        norm_linear_triton,
        norm_swiglu_triton,
    )
    from specsched.kernels.norm import add_rms_norm
    from specsched.kernels.small_linear import small_linear_triton

    layer, cfg = model.model.layers[0], model.cfg
    ln, eps = layer.input_layernorm.weight, cfg.rms_norm_eps
    x = torch.randn(m, cfg.hidden_size, device="cuda").bfloat16()
    residual = torch.randn_like(x)
    gemms = {  # name: (weight, kind): the prologue in front of the GEMM
        "qkv": (layer.self_attn.qkv_proj.weight, "norm"),
        "gate_up": (layer.mlp.gate_up_proj.weight, "norm"),
        "gate_up+swiglu": (layer.mlp.gate_up_proj.weight, "swiglu"),
        "o_proj": (layer.self_attn.o_proj.weight, "plain"),
        "down": (layer.mlp.down_proj.weight, "plain"),
        "lm_head": (model.lm_head.weight, "norm"),
    }
    rows = []
    for name, (w, kind) in gemms.items():
        n, k = w.shape[0] // (2 if kind == "swiglu" else 1), w.shape[1]
        default = fused_linear_config(n, k, torch.bfloat16)
        configs = {"default": default}
        for bn, bk in ((16, 64), (16, 256), (32, 128), (64, 64), (64, 128)):
            c = FusedLinearConfig(bn, bk, num_warps=4, num_stages=3)
            if c != default:
                configs[f"{bn}x{bk}"] = c
        for warps in (2, 8):  # a 16-row tile is little work for 4 warps; more warps, more loads in flight
            configs[f"{default.block_n}x{default.block_k} w{warps}"] = replace(default, num_warps=warps)
        if kind == "plain":  # small_linear vs cuBLAS (model.fused_linear_gemms)
            a = torch.randn(m, k, device="cuda").bfloat16()
            graphs = {"unfused": graph_of(lambda w=w, a=a: F.linear(a, w))}
            for c_name, c in configs.items():
                graphs[c_name] = graph_of(lambda w=w, a=a, c=c: small_linear_triton(a, w, config=c))
        elif kind == "swiglu":
            graphs = {
                "unfused": graph_of(
                    lambda w=w: silu_and_mul(F.linear(add_rms_norm(x, residual, ln, eps)[0], w))
                )
            }
            for c_name, c in configs.items():
                graphs[c_name] = graph_of(
                    lambda w=w, c=c: norm_swiglu_triton(x, residual, ln, eps, w, config=c)
                )
        else:
            graphs = {"unfused": graph_of(lambda w=w: F.linear(add_rms_norm(x, residual, ln, eps)[0], w))}
            for c_name, c in configs.items():
                graphs[c_name] = graph_of(
                    lambda w=w, c=c: norm_linear_triton(x, residual, ln, eps, w, config=c)
                )
        runs = compare(graphs, args.repeats, args.replays)
        med = {g: statistics.median(r) for g, r in runs.items()}
        best = min((g for g in med if g != "unfused"), key=med.__getitem__)
        rows.append([key, name, f"{n}x{k}", str(m), fmt_runs(runs["unfused"]), fmt_runs(runs["default"]),
                     f"{default.block_n}x{default.block_k}", best, f"{med[best]:.1f}"])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--ctx", type=int, default=512, help="cached tokens per row (the attention's length)")
    p.add_argument(
        "--parts", nargs="+", choices=["layer", "forward", "gemm"], default=["layer", "forward", "gemm"]
    )
    p.add_argument("--no-profile", action="store_true", help="skip the kernel counts (torch.profiler)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench.fused_linear needs a CUDA device (it times CUDA graph replays); none here", file=sys.stderr
        )
        return 2
    if args.repeats < 1 or args.replays < 1:
        p.error("--repeats and --replays must be >= 1")
    from specsched.bench.markdown import table

    out: dict[str, list[list[str]]] = {"layer": [], "forward": [], "gemm": []}
    for key in args.models:
        bench_model(key, args, out)
    head = ["model", "M", "unfused us", "fused us", "fused + own GEMMs us", "fused/unfused",
            "+ GEMMs/unfused", "kernels unfused", "kernels fused", "kernels + GEMMs"]  # fmt: skip
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, ctx {args.ctx}, "
          f"median (min-max) of {args.repeats} runs x {args.replays} replays")  # fmt: skip
    if out["layer"]:
        print("\n### One decoder layer (layer 0), bf16\n\n" + table(head, out["layer"]))
    if out["forward"]:
        diffs = ["logits rel. L2 diff fused", "... + GEMMs"]
        print("\n### Whole forward, bf16\n\n" + table(head + diffs, out["forward"]))
    if out["gemm"]:
        gh = ["model", "GEMM", "N x K", "M", "unfused us", "fused default us", "default", "best", "best us"]
        print(
            "\n### Each fused GEMM vs its unfused pair (norm / SwiGLU + cuBLAS; o_proj and down: small_linear"
            " vs cuBLAS), bf16\n\n" + table(gh, out["gemm"])
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
