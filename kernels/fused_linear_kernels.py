"""The Triton kernels of :mod:`specsched.kernels.fused_linear` (its docstring: what they compute,
how they round, why a row does not depend on the others), launched only by its wrappers.

Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); program (i, j) owns rows i*BLOCK_M.. (masked past M) and
output columns j*BLOCK_N.., and reduces them over the whole of K in BLOCK_K chunks, in order. In
``_norm_swiglu_kernel`` N is the intermediate size and program j reduces two column blocks, j of the
gate and j of the up projection, so that its epilogue has both halves of its SwiGLU outputs.
``_small_linear_kernel`` is the same GEMM with no prologue.

``USE_PDL`` (:mod:`specsched.kernels.pdl`): each program first prefetches the start of its weight
rows (and the norm's weight) into L2 (with ``PREFETCH``), then waits for the kernel before and lets
the next one start (in ``TRIGGER_FIRST``'s order).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from specsched.kernels.pdl import pdl_start, prefetch_rows_l2
from specsched.kernels.triton_utils import round_to, runtime_args


@triton.jit
def _rows_chunk(x_ptr, res_ptr, offs_m, kk, mask, stride_x, stride_r, dtype: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr, EMULATE_BF16: tl.constexpr):  # fmt: skip
    """[BLOCK_M, BLOCK_K] of ``x + residual`` rounded to ``dtype`` (or of ``x``)."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + kk[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * stride_r + kk[None, :], mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), dtype, EMULATE_BF16)
    return x


@triton.jit
def _dot_chunk(acc, a, w_ptr, offs_n, kk, n_valid, k_valid, stride_w, PRECISION: tl.constexpr,
               UPCAST: tl.constexpr):  # fmt: skip
    """``acc += a @ W[offs_n, kk].T`` (fp32 accumulator)."""
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + kk[None, :],
                mask=n_valid[:, None] & k_valid[None, :], other=0.0)  # fmt: skip
    if UPCAST:  # the interpreter's tl.dot is wrong on bf16: exact fp32 products instead
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def _store_out(acc, b_ptr, y_ptr, offs_m, offs_n, m_valid, n_valid, stride_y, HAS_BIAS: tl.constexpr,
               EMULATE_BF16: tl.constexpr):  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    y = round_to(acc, y_ptr.dtype.element_ty, EMULATE_BF16)
    mask = m_valid[:, None] & n_valid[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], y, mask=mask)


@triton.jit
def _row_rstd(x_ptr, res_ptr, res_out_ptr, offs_m, m_valid, stride_x, stride_r, stride_ro, eps, inv_k,
              K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr, EMULATE_BF16: tl.constexpr):  # fmt: skip
    """Pass 1: ``rsqrt(mean(s^2) + eps)`` per row of ``s = x + residual`` rounded to ``dtype`` (or of
    ``x``) -> [BLOCK_M] fp32; the programs of the first column block write ``s``, the new residual."""
    offs_k = tl.arange(0, BLOCK_K)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask = m_valid[:, None] & (kk < K)[None, :]
        s = _rows_chunk(x_ptr, res_ptr, offs_m, kk, mask, stride_x, stride_r, dtype, HAS_RESIDUAL,
                        EMULATE_BF16)  # fmt: skip
        if HAS_RESIDUAL:
            if tl.program_id(1) == 0:  # written once: by the first column block
                tl.store(res_out_ptr + offs_m[:, None] * stride_ro + kk[None, :], s, mask=mask)
        s = s.to(tl.float32)
        sq += tl.sum(s * s, 1)
    return tl.rsqrt(sq * inv_k + eps)  # mean as torch's CUDA reduction forms it: sum * fl(1/K)


@triton.jit
def _normed_chunk(x_ptr, res_ptr, nw_ptr, offs_m, kk, m_valid, k_valid, rstd, stride_x, stride_r,
                  dtype: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EMULATE_BF16: tl.constexpr):  # fmt: skip
    """Pass 2's GEMM operand: ``norm_weight * round(s * rstd)``, rounded as the reference rounds it."""
    s = _rows_chunk(x_ptr, res_ptr, offs_m, kk, m_valid[:, None] & k_valid[None, :], stride_x, stride_r,
                    dtype, HAS_RESIDUAL, EMULATE_BF16).to(tl.float32)  # fmt: skip
    xn = round_to(s * rstd[:, None], dtype, EMULATE_BF16).to(tl.float32)
    nw = tl.load(nw_ptr + kk, mask=k_valid, other=0.0).to(tl.float32)
    return round_to(nw[None, :] * xn, dtype, EMULATE_BF16)


@triton.jit(**runtime_args(ints=("M",)))
def _norm_linear_kernel(
    x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, res_out_ptr, M,
    stride_x, stride_r, stride_w, stride_y, stride_ro, eps, inv_k,
    N: tl.constexpr, K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EMULATE_BF16: tl.constexpr, USE_PDL: tl.constexpr = False,
    TRIGGER_FIRST: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):  # fmt: skip
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid, n_valid = offs_m < M, offs_n < N
    dtype = y_ptr.dtype.element_ty
    if USE_PDL and PREFETCH:  # the weights first: no kernel writes them
        prefetch_rows_l2(w_ptr, offs_n, N, stride_w, K)
        prefetch_rows_l2(nw_ptr, tl.arange(0, 1), 1, K, K)
    pdl_start(USE_PDL, TRIGGER_FIRST)
    rstd = _row_rstd(x_ptr, res_ptr, res_out_ptr, offs_m, m_valid, stride_x, stride_r, stride_ro, eps,
                     inv_k, K, BLOCK_M, BLOCK_K, dtype, HAS_RESIDUAL, EMULATE_BF16)  # fmt: skip
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # pass 2: normalise a chunk, multiply it with W's chunk
        kk = k0 + offs_k
        k_valid = kk < K
        a = _normed_chunk(x_ptr, res_ptr, nw_ptr, offs_m, kk, m_valid, k_valid, rstd, stride_x, stride_r,
                          dtype, HAS_RESIDUAL, EMULATE_BF16)  # fmt: skip
        acc = _dot_chunk(acc, a, w_ptr, offs_n, kk, n_valid, k_valid, stride_w, PRECISION, UPCAST)
    _store_out(acc, b_ptr, y_ptr, offs_m, offs_n, m_valid, n_valid, stride_y, HAS_BIAS, EMULATE_BF16)


@triton.jit(**runtime_args(ints=("M",)))
def _norm_swiglu_kernel(
    x_ptr, res_ptr, nw_ptr, w_ptr, y_ptr, res_out_ptr, M,
    stride_x, stride_r, stride_w, stride_y, stride_ro, eps, inv_k,
    INTER: tl.constexpr, K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EMULATE_BF16: tl.constexpr, USE_PDL: tl.constexpr = False,
    TRIGGER_FIRST: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):  # fmt: skip
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid, n_valid = offs_m < M, offs_n < INTER
    dtype = y_ptr.dtype.element_ty
    if USE_PDL and PREFETCH:  # the weights first (gate rows, up rows, the norm's): no kernel writes them
        prefetch_rows_l2(w_ptr, offs_n, INTER, stride_w, K)
        prefetch_rows_l2(w_ptr, INTER + tl.minimum(offs_n, INTER - 1), 2 * INTER, stride_w, K)
        prefetch_rows_l2(nw_ptr, tl.arange(0, 1), 1, K, K)
    pdl_start(USE_PDL, TRIGGER_FIRST)
    rstd = _row_rstd(x_ptr, res_ptr, res_out_ptr, offs_m, m_valid, stride_x, stride_r, stride_ro, eps,
                     inv_k, K, BLOCK_M, BLOCK_K, dtype, HAS_RESIDUAL, EMULATE_BF16)  # fmt: skip
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # pass 2: one normalised chunk, both weight chunks
        kk = k0 + offs_k
        k_valid = kk < K
        a = _normed_chunk(x_ptr, res_ptr, nw_ptr, offs_m, kk, m_valid, k_valid, rstd, stride_x, stride_r,
                          dtype, HAS_RESIDUAL, EMULATE_BF16)  # fmt: skip
        acc_g = _dot_chunk(acc_g, a, w_ptr, offs_n, kk, n_valid, k_valid, stride_w, PRECISION, UPCAST)
        acc_u = _dot_chunk(acc_u, a, w_ptr, INTER + offs_n, kk, n_valid, k_valid, stride_w, PRECISION,
                           UPCAST)  # fmt: skip
    # epilogue, rounded as silu_and_mul_ref over the rounded GEMM output: silu(g), then its product
    # with u. Rows past M (not stored) take g = 1, not 0: the IEEE division's range check (FCHK) may
    # send a zero dividend down its slow path, for 15 of 16 rows at M = 1.
    g = tl.where(m_valid[:, None], round_to(acc_g, dtype, EMULATE_BF16).to(tl.float32), 1.0)
    u = round_to(acc_u, dtype, EMULATE_BF16).to(tl.float32)
    if LIBDEVICE_EXP:  # as torch's CUDA silu (activation.py)
        e = libdevice.exp(-g)
    else:  # the interpreter has no libdevice
        e = tl.exp(-g)
    act = round_to(tl.math.div_rn(g, 1.0 + e), dtype, EMULATE_BF16).to(tl.float32)
    h = round_to(act * u, dtype, EMULATE_BF16)
    tl.store(
        y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], h, mask=m_valid[:, None] & n_valid[None, :]
    )


@triton.jit(**runtime_args(ints=("M",)))
def _small_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, stride_x, stride_w, stride_y,
    N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, EMULATE_BF16: tl.constexpr, USE_PDL: tl.constexpr = False,
    TRIGGER_FIRST: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):  # fmt: skip
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid, n_valid = offs_m < M, offs_n < N
    if USE_PDL and PREFETCH:  # the weights first: no kernel writes them
        prefetch_rows_l2(w_ptr, offs_n, N, stride_w, K)
    pdl_start(USE_PDL, TRIGGER_FIRST)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # no prologue: x's chunk as it is
        kk = k0 + offs_k
        k_valid = kk < K
        mask = m_valid[:, None] & k_valid[None, :]
        a = tl.load(x_ptr + offs_m[:, None] * stride_x + kk[None, :], mask=mask, other=0.0)
        acc = _dot_chunk(acc, a, w_ptr, offs_n, kk, n_valid, k_valid, stride_w, PRECISION, UPCAST)
    _store_out(acc, b_ptr, y_ptr, offs_m, offs_n, m_valid, n_valid, stride_y, HAS_BIAS, EMULATE_BF16)
