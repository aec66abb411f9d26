"""Does programmatic dependent launch (PDL) shorten a chain of small kernels in a CUDA graph? (issue 17)

SmolLM2's batch-1 forward is ~300 kernels of ~3 µs inside one CUDA graph (0.95 ms on an H100,
docs/benchmarks.md): launch-bound, each kernel's weights stream in well under a microsecond. With
PDL (Hopper and later) a kernel launched with the programmatic-serialization attribute may start
while the kernel before it is still running; it must execute ``griddepcontrol.wait`` before it reads
what that kernel wrote, but it can load its own weights (never written) before the wait, and the
kernel before it can let it start early with ``griddepcontrol.launch_dependents``.

This probe times a chain of GEMV kernels with SmolLM2's widths (576 → 1536 → 576 → ...), ``y_{i+1}
= W_i y_i``, captured in one CUDA graph, in variants:

- ``off``: plain launches (what the engine does today)
- ``pdl``: PDL launches, each kernel waits before any load
- ``pdl_prefetch``: PDL, each kernel loads its weight tile before the wait
- ``pdl_prefetch_trigger``: as above, and each kernel lets its dependent launch at its start
- ``pdl_l2_trigger``: PDL and the early trigger, the weight tile prefetched into L2 (``prefetch.global.L2``,
  one per 128-byte line) before the wait and loaded after it: what a GEMM whose weight slice does not
  fit in registers can do
- ``cublas_mix``: every other link a cuBLAS GEMM (``F.linear``), the Triton links plain
- ``cublas_mix_pdl``: the same, the Triton links ``pdl_prefetch_trigger`` (PDL behind cuBLAS)

and prints µs per chain and per kernel, each variant's output against ``off`` (any difference would
be a race: the arithmetic is the same). Off CUDA (``TRITON_INTERPRET=1``) only ``off`` runs.

``python -m specsched.bench.pdl_probe [--links 300] [--replays 50] [--repeats 7]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specsched.bench.fused_linear import graph_of, time_run
from specsched.bench.markdown import fmt, table
from specsched.kernels.pdl import prefetch_l2

WIDTHS = (576, 1536)  # SmolLM2-135M: hidden, intermediate
BLOCK_N = 8
VARIANTS = (
    "off",
    "pdl",
    "pdl_prefetch",
    "pdl_prefetch_trigger",
    "pdl_l2_trigger",
    "cublas_mix",
    "cublas_mix_pdl",
)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, N, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
    TRIGGER: tl.constexpr, L2: tl.constexpr,
):  # fmt: skip
    """y[n] = Σ_k W[n, k] x[k] for this program's BLOCK_N rows (one tile: K <= BLOCK_K)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_mask = (rows[:, None] < N) & (cols[None, :] < K)
    if USE_PDL:
        if TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
        if L2:  # a pointer per 128-byte line (64 bf16), clamped inside the tile
            lines = tl.minimum(tl.arange(0, BLOCK_K // 64) * 64, K - 1)
            prefetch_l2(w_ptr + tl.minimum(rows, N - 1)[:, None] * K + lines[None, :])
            tl.extra.cuda.gdc_wait()
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=w_mask, other=0.0)
        elif PREFETCH:
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=w_mask, other=0.0)
            tl.extra.cuda.gdc_wait()
        else:
            tl.extra.cuda.gdc_wait()
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=w_mask, other=0.0)
    else:
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=w_mask, other=0.0)
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, variant: str = "off") -> torch.Tensor:
    """``out`` [N] = ``w`` [N, K] @ ``x`` [K] by the probe's kernel, launched as ``variant`` says."""
    n, k = w.shape
    if x.shape != (k,) or out.shape != (n,) or not w.is_contiguous():
        raise ValueError(f"gemv: x {tuple(x.shape)}, w {tuple(w.shape)} (contiguous), out {tuple(out.shape)}")
    use_pdl = variant.startswith("pdl") or variant == "cublas_mix_pdl"
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, w, out, n, k, BLOCK_N=BLOCK_N, BLOCK_K=triton.next_power_of_2(k), USE_PDL=use_pdl,
        PREFETCH="prefetch" in variant or variant == "cublas_mix_pdl",
        TRIGGER="trigger" in variant or variant == "cublas_mix_pdl", L2="l2" in variant, num_warps=4,
        **({"launch_pdl": True} if use_pdl else {}),
    )  # fmt: skip
    return out


class Chain:
    """``links`` GEMVs, widths alternating :data:`WIDTHS`, with static buffers (graph-capturable)."""

    def __init__(self, links: int, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        dims = [WIDTHS[i % 2] for i in range(links + 1)]
        scale = [d**-0.5 for d in dims]
        self.weights = [  # [N_i, K_i]
            (torch.randn(dims[i + 1], dims[i], generator=g) * scale[i]).to(device, dtype)
            for i in range(links)
        ]
        self.bufs = [torch.zeros(d, device=device, dtype=dtype) for d in dims]
        self.bufs[0].copy_(torch.randn(dims[0], generator=g).to(dtype))

    def run(self, variant: str) -> torch.Tensor:
        for i, w in enumerate(self.weights):
            if variant.startswith("cublas_mix") and i % 2 == 1:
                self.bufs[i + 1].copy_(F.linear(self.bufs[i][None], w)[0])  # GEMM + copy: 2 kernels
            else:
                gemv(self.bufs[i], w, self.bufs[i + 1], variant)
        return self.bufs[-1]


def time_variant(chain: Chain, variant: str, replays: int, repeats: int) -> tuple[float, torch.Tensor]:
    """Median µs of one graph replay of the chain (``repeats`` runs of ``replays``), and its output."""
    graph = graph_of(lambda: chain.run(variant))
    times = [time_run(graph, replays) for _ in range(repeats)]
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(times), chain.bufs[-1].clone()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", type=int, default=300)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        chain = Chain(4, "cpu", torch.float32)
        ref = chain.bufs[0]
        for w in chain.weights:
            ref = w @ ref
        diff = float((chain.run("off") - ref).abs().max())
        print(f"no CUDA: the chain's 'off' variant against torch, max |diff| {diff:.2e}")
        return 0
    major, _ = torch.cuda.get_device_capability()
    variants = VARIANTS if major >= 9 else ("off", "cublas_mix")
    chain = Chain(args.links, "cuda")
    rows, ref, base = [], None, None
    for variant in variants:
        us, out = time_variant(chain, variant, args.replays, args.repeats)
        kernels = args.links + (args.links // 2 if variant.startswith("cublas_mix") else 0)
        if variant == "off":
            ref, base = out, us
        diff = float((out.float() - ref.float()).abs().max()) if ref is not None else 0.0
        rows.append([variant, kernels, fmt(us, 1), fmt(us / kernels, 2), fmt(us / base, 3), f"{diff:.1e}"])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(table(["variant", "kernels", "µs / chain", "µs / kernel", "vs off", "max |diff| vs off"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
