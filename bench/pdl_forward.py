"""What ``model.pdl`` buys on the GPU: whole decode forwards as CUDA graph replays, each layer path
(unfused, fused, fused + own GEMMs: bench/fused_linear.py) captured with and without programmatic
dependent launch (kernels/pdl.py), at the row counts decode and verify steps run.

    python -m specsched.bench.pdl_forward [--models smollm2 7b] [--rows 1 4 16] [--repeats 7]
        [--replays 200] [--ctx 512] [--modes after before before_all] [--prefetch-max-mb 8]

CUDA with compute capability >= 9.0 only (exits 2 with a message elsewhere). Random bf16 weights in
the models' shapes, each of M rows decoding one token over ``--ctx`` cached tokens. Prints a markdown
table: µs per replay, median (min-max) over ``--repeats`` interleaved runs of ``--replays`` replays,
without PDL and in each mode (kernels/pdl.py ``PdlMode``): ``after`` / ``before`` = the dependent
triggered after / before the wait, weights prefetched up to ``--prefetch-max-mb``; ``before_all`` =
triggered before the wait, every weight prefetched (the first version). Each mode's ratio to the
same path without PDL, and whether all modes' logits equal that graph's bit for bit (the kernels
compute the same thing; only when they start differs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from specsched.bench.fused_linear import MODELS, compare, decode_batch, fmt_runs, graph_of
from specsched.kernels.pdl import PdlMode, pdl_enabled

PATHS = ("unfused", "fused", "gemms")  # gemms: fused, the output / down projections in small_linear
MODES = ("after", "before", "before_all")


def mode_of(name: str, prefetch_max_mb: float) -> PdlMode:
    if name not in MODES:
        raise ValueError(f"unknown PDL mode {name!r}; known: {', '.join(MODES)}")
    trigger = "after" if name == "after" else "before"
    return PdlMode(
        on=True, trigger=trigger, prefetch_max_mb=float("inf") if name == "before_all" else prefetch_max_mb
    )


def time_gapped(graph: torch.cuda.CUDAGraph, replays: int, gap_us: float) -> float:
    """µs per replay, each replay alone on an idle device: synchronised, then ``gap_us`` of host spin
    before the next (as the daemon's GPU waits for the host between steps); events around each."""
    total = 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        torch.cuda.synchronize()
        until = time.perf_counter() + gap_us * 1e-6
        while time.perf_counter() < until:
            pass
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        total += start.elapsed_time(end) * 1e3
    return total / replays


def bench_rows(key: str, model, m: int, args) -> list[list[str]]:
    """One table row per layer path at M = ``m``."""
    ids, pos, meta, kv = decode_batch(model, m, args.ctx)
    graphs, logits = {}, {}
    modes = {"off": PdlMode()} | {name: mode_of(name, args.prefetch_max_mb) for name in args.modes}
    for path in PATHS:
        model.set_fused_linear(path != "unfused", gemms=path == "gemms")
        for mode_name, mode in modes.items():
            name = f"{path}/{mode_name}"
            with pdl_enabled(mode):
                graphs[name] = graph_of(lambda n=name: logits.__setitem__(n, model(ids, pos, meta, kv)))
    model.set_fused_linear(False)
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    if args.gap_us > 0:
        runs = {name: [] for name in graphs}
        for _ in range(args.repeats):  # interleaved, as compare()
            for name, g in graphs.items():
                runs[name].append(time_gapped(g, args.replays, args.gap_us))
    else:
        runs = compare(graphs, args.repeats, args.replays)
    base = statistics.median(runs["unfused/off"])
    rows = []
    for path in PATHS:
        off = statistics.median(runs[f"{path}/off"])
        cells = [key, str(m), path, fmt_runs(runs[f"{path}/off"]), f"{off / base:.3f}"]
        for mode_name in args.modes:
            t = runs[f"{path}/{mode_name}"]
            cells += [fmt_runs(t), f"{statistics.median(t) / off:.3f}"]
        same = all(torch.equal(logits[f"{path}/off"], logits[f"{path}/{n}"]) for n in args.modes)
        rows.append([*cells, "yes" if same else "**no**"])
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["smollm2"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--ctx", type=int, default=512, help="cached tokens per row (the attention's length)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "--gap-us",
        type=float,
        default=0.0,
        help="> 0: time each replay alone, the device idle this long before it (as between steps)",
    )
    p.add_argument("--prefetch-max-mb", type=float, default=PdlMode().prefetch_max_mb)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print(
            "bench.pdl_forward needs a CUDA device of compute capability >= 9.0; none here", file=sys.stderr
        )
        return 2
    if args.repeats < 1 or args.replays < 1:
        p.error("--repeats and --replays must be >= 1")
    from specsched.bench.common import random_model
    from specsched.bench.markdown import table
    from specsched.kernels.fused_linear import FUSED_MAX_ROWS

    rows = []
    for key in args.models:
        model = random_model(MODELS[key], torch.device("cuda"), torch.bfloat16, is_decisive=False)
        with torch.inference_mode():
            for m in args.rows:
                if m > FUSED_MAX_ROWS:
                    print(f"skipping M = {m}: the model fuses forwards of at most {FUSED_MAX_ROWS} rows")
                    continue
                rows += bench_rows(key, model, m, args)
        del model
        torch.cuda.empty_cache()
    head = ["model", "M", "path", "µs, no PDL", "/ unfused"]
    for name in args.modes:
        head += [f"µs, {name}", f"{name} / no PDL"]
    head.append("logits equal")
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, ctx {args.ctx}, "
          f"median (min-max) of {args.repeats} runs x {args.replays} replays, prefetch <= "
          f"{args.prefetch_max_mb:g} MB in after / before\n")  # fmt: skip
    print(table(head, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
