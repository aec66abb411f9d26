"""Batch-invariant linear layer ``y = x @ w.T (+ b)``: a Triton kernel, its torch reference and a
batch-invariant torch fallback (``model.deterministic``).

What "batch-invariant" means here: row i of ``y`` is a function of row i of ``x``, ``w`` and ``b``
alone, bit for bit: it does not depend on M (the number of rows) or on what the other rows hold. A
GEMM library does not promise this: cuBLAS picks its kernel, tile and split-K from (M, N, K), so the
same token's logits come out of differently rounded sums in a decode batch of 3 and in an MQA batch
of 27 rows, and bf16 rounding then flips near-ties (issue 16).

Guarantees, by path:

- Triton (CUDA; CPU under ``TRITON_INTERPRET=1``): the launch config (:func:`matmul_config`: tiles
  ``BLOCK_M x BLOCK_N``, the K step ``BLOCK_K``, warps, stages) is a function of (N, K, dtype) only,
  and ``M`` is a runtime argument kept out of Triton's specialisation (``runtime_args``), so every M
  runs one compiled kernel. Each program owns one output tile and one of ``split_k`` fixed slices
  of K, and walks its slice in ``BLOCK_K`` steps into an fp32 accumulator; rows past M load zeros and
  are not stored. With ``split_k > 1`` a second kernel sums the slices' fp32 partials in slice order
  (no atomics). The split points are a function of (N, K) like the rest of the config, so an output
  element is always the same sequence of the same MMA instructions over the same operands, then the
  same ordered sum, wherever its row sits in its tile: row i is bitwise independent of the batch.
  (Split-K is what small-M GEMMs need for parallelism; what breaks batch invariance in a GEMM library
  is choosing it from M, not using it.) The bias is added in fp32 after the reduction, then the
  result is rounded once to ``x.dtype``.
- torch fallback (CPU without the interpreter): one ``torch.mv`` per row, on a fresh (allocator-
  aligned) copy of that row, so every row meets the CPU BLAS with the same shape, strides and
  alignment; the bias is added in ``x.dtype``. Row i is then bitwise independent of the batch as long
  as the BLAS is deterministic for a fixed call (it is for a fixed thread count, which torch keeps per
  process). Slow (M BLAS calls): it exists for CPU tests and development, not for serving.

The two paths agree with :func:`linear_ref` to rounding, not bitwise with each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specsched.kernels.triton_utils import (
    FLOAT_DTYPES,
    FP_FUSION,
    cdiv,
    check_launchable,
    emulate_bf16,
    is_interpreted,
    next_pow2,
    round_to,
    runtime_args,
)


def linear_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], x.dtype
    """Torch reference: the product in fp32, rounded once to ``x.dtype`` (not batch-invariant)."""
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int  # output rows per program: fixed, never chosen from M
    block_n: int  # output columns per program
    block_k: int  # the reduction step: every output element sums K in this order, 0 .. K
    num_warps: int
    num_stages: int
    split_k: int = 1  # fixed slices of K, each summed by its own program, then in slice order

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MatmulConfig.{name} must be a power of 2 >= 16, got {v}")
        if self.split_k < 1:
            raise ValueError(f"MatmulConfig.split_k must be >= 1, got {self.split_k}")

    def k_per_split(self, k: int) -> int:
        """The width of each K slice: a multiple of ``block_k`` (the last slice may be shorter)."""
        return cdiv(cdiv(k, self.block_k), self.split_k) * self.block_k

    def num_splits(self, k: int) -> int:
        """Slices that hold at least one K step (``split_k`` or fewer for a short K)."""
        return cdiv(k, self.k_per_split(k))


def matmul_config(n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """The launch config of an [M, K] x [K, N] product, from (N, K, dtype) only (never M).

    One 64-row tile serves decode batches and prefill chunks alike: decode rows are bound by the
    weight reads, which the tile count over N spreads (64 columns per program; 128 for the LM head's
    wide N), and padding rows cost tensor-core time only. A narrow layer with a long K (SmolLM2's
    down projection, N = 576, K = 1536: 9 column tiles walking 24 K steps each) splits K into at
    most 4 fixed slices of >= 384. Measured on the H200 with a 30-layer stack of distinct weights in
    one CUDA graph (docs/benchmarks.md, "Where the mode's time goes", 2026-12-04): the split takes SmolLM2's
    down projections from 314 to 181 us at M = 1 and from 410 to 618 us at M = 2048; 32-column
    tiles, faster at M <= 144, cost 45 % more at M = 2048 (prefill), so they are not used. Wide
    layers (N >= 64 tiles: 7B) are left unsplit. ``tl.dot`` needs every dimension >= 16.
    """
    wide = dtype in (torch.float16, torch.bfloat16)
    block_k = min(64 if wide else 32, max(16, next_pow2(k)))
    block_n = 128 if n >= 16384 else 64
    block_n = min(block_n, max(16, next_pow2(n)))
    split_k = 1
    if k > 1024 and cdiv(n, block_n) < 64:
        split_k = min(4, k // 384)
    return MatmulConfig(64, block_n, block_k, num_warps=4, num_stages=3 if wide else 2, split_k=split_k)


@triton.jit(**runtime_args(ints=("M",)))
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, stride_xm, stride_wn, stride_ym,
    N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr, IS_PARTIAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """One output tile over one K slice. ``IS_PARTIAL``: store the fp32 sum into slice
    ``program_id(2)`` of the [splits, M, N] workspace ``y_ptr``; otherwise add the bias and round."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_PER_SPLIT
    m_valid = offs_m < M
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):  # the one reduction order: the slice ascending
        k_valid = offs_k < K - k_start - k0
        x = tl.load(x_ptrs, mask=m_valid[:, None] & k_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptrs, mask=n_valid[:, None] & k_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = m_valid[:, None] & n_valid[None, :]
    if IS_PARTIAL:
        part = y_ptr + tl.program_id(2).to(tl.int64) * M * N
        tl.store(part + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        y = round_to(acc, y_ptr.dtype.element_ty, EMULATE_BF16)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=mask)


@triton.jit(**runtime_args(ints=("M",)))
def _sum_splits_kernel(
    part_ptr, b_ptr, y_ptr, M, stride_ym,
    N: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(0)``: the [SPLITS, M, N] fp32 partials summed in slice order, + bias, rounded."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    acc = tl.load(part_ptr + row * N + offs_n, mask=n_valid, other=0.0)
    for s in tl.static_range(1, SPLITS):  # slice order, the same for every row and every M
        acc += tl.load(part_ptr + (s * M + row) * N + offs_n, mask=n_valid, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)
    y = round_to(acc, y_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(y_ptr + row * stride_ym + offs_n, y, mask=n_valid)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    op = "batch_invariant_linear"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{op}: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"{op}: x and weight must share one of {FLOAT_DTYPES}, got {x.dtype}, {weight.dtype}"
        )
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"{op}: bias must be [N={weight.shape[0]}] {x.dtype}, got {tuple(bias.shape)} "
                         f"{bias.dtype}")  # fmt: skip
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}")


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: MatmulConfig | None
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    cfg = config or matmul_config(n, k, x.dtype)
    # The interpreter (triton 3.9) gets tl.dot wrong on bf16 operands: compute those dots in fp32.
    upcast = x.dtype == torch.bfloat16 and is_interpreted()
    splits = cfg.num_splits(k)
    is_partial = splits > 1
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if is_partial else y
    grid = (cdiv(m, cfg.block_m), cdiv(n, cfg.block_n), splits)
    _linear_kernel[grid](
        x, weight, bias if bias is not None else y, part, m, x.stride(0), weight.stride(0), y.stride(0),
        N=n, K=k, K_PER_SPLIT=cfg.k_per_split(k), IS_PARTIAL=is_partial, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        EMULATE_BF16=emulate_bf16(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **FP_FUSION,
    )  # fmt: skip
    if is_partial:
        block_n = min(1024, next_pow2(n))
        _sum_splits_kernel[(m, cdiv(n, block_n))](
            part, bias if bias is not None else y, y, m, y.stride(0),
            N=n, SPLITS=splits, HAS_BIAS=bias is not None, BLOCK_N=block_n,
            EMULATE_BF16=emulate_bf16(x.dtype), **FP_FUSION,
        )  # fmt: skip
    return y


def linear_rows_torch(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """The batch-invariant torch fallback: one ``torch.mv`` per row on a fresh copy of the row."""
    _check(x, weight, bias)
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    for i in range(x.shape[0]):
        row = torch.mv(weight, x[i].clone())  # [N]
        y[i] = row + bias if bias is not None else row
    return y


def linear_triton(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: MatmulConfig | None = None,  # tests only: another fixed config
) -> torch.Tensor:  # [M, N]
    """One launch; CUDA tensors (or CPU under ``TRITON_INTERPRET=1``)."""
    _check(x, weight, bias)
    check_launchable("batch_invariant_linear", x=x, weight=weight)
    return _launch(x, weight, bias, config)


def batch_invariant_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """``x @ weight.T + bias`` with row i independent of the other rows: the Triton kernel on CUDA and
    under the interpreter, the per-row torch fallback on CPU otherwise (see the module docstring)."""
    _check(x, weight, bias)
    if x.is_cuda or is_interpreted():
        check_launchable("batch_invariant_linear", x=x, weight=weight)
        return _launch(x, weight, bias, None)
    return linear_rows_torch(x, weight, bias)
