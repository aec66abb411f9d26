"""Small-M linear layers with their elementwise prologue fused in: Triton kernels + torch references.

- :func:`norm_linear`: (residual add +) RMSNorm (Zhang & Sennrich, 2019, "Root Mean Square Layer
  Normalization") in the prologue of ``y = normed @ W.T (+ bias)``: a decoder layer's
  ``add_rms_norm`` -> QKV (or gate/up, or the final norm -> LM head) in one launch.
- :func:`norm_swiglu`: the same prologue in front of the fused gate/up projection, with SwiGLU
  (Shazeer, 2020, "GLU Variants Improve Transformer") in its epilogue: ``add_rms_norm`` -> gate/up ->
  ``silu(gate) * up`` in one launch, writing the ``[M, intermediate]`` input of the down projection
  (which stays a cuBLAS GEMM).

SwiGLU sits in the gate/up epilogue, where each of its outputs is computed once. An earlier kernel put
it in the down projection's prologue instead, where every program recomputed SiLU over the whole
intermediate row: on the H200 (2026-12-05, docs/benchmarks.md) it took 127 us at M = 1 against 8.3 for
SwiGLU + cuBLAS.

Meant for decode/verify shapes (M <= :data:`FUSED_MAX_ROWS` token rows), where a step is bound by
launches and weight reads: rows are padded with masks to one 16-row ``tl.dot`` tile and each program
owns ``BLOCK_N`` output columns for the whole of K (no split-K, so no second launch). It walks K in
``BLOCK_K`` chunks, so K may be any size (8192 and more): each kernel first sums the squares of
its rows (pass 1), then normalises each chunk and multiplies it with the weight chunk (pass 2). Every
program recomputes the row statistics (M x K elements, from L2) instead of exchanging them.

Rounding is the references' (:func:`~specsched.kernels.norm.add_rms_norm_ref`,
:func:`~specsched.kernels.activation.silu_and_mul_ref`): ``x + residual`` rounded to the model dtype,
fp32 statistics, the normalised row rounded, times the norm weight rounded again; the product
accumulates in fp32 and is rounded once (after the bias); SwiGLU takes the rounded gate and up, rounds
SiLU, then its product with ``up``. Only the accumulation order differs from cuBLAS / the CPU's GEMM.
``new_residual`` (``x + residual``) is written by the programs of the first column block alone,
bitwise as torch's add.

Batch invariance: the launch config comes from (N, K, dtype) only, M is a runtime argument kept out
of Triton's specialisation, and every output element is reduced by one program over K in one fixed
chunk order, with statistics per row; a row's tile position only selects which MMA lanes hold it. So
row i of ``y`` is bitwise independent of M and of the other rows (tested under the interpreter and
on the GPU). The model's option (``model.fused_linear``) is not batch-invariant all the same: forwards
of more than 16 rows take the unfused cuBLAS path, so it is refused together with
``model.deterministic``.

The ``@triton.jit`` kernels are in :mod:`specsched.kernels.fused_linear_kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specsched.kernels.activation import silu_and_mul_ref
from specsched.kernels.fused_linear_kernels import _norm_linear_kernel, _norm_swiglu_kernel
from specsched.kernels.norm import add_rms_norm_ref, rms_norm_ref
from specsched.kernels.pdl import pdl_args
from specsched.kernels.triton_utils import (
    NO_FP_FUSION,
    cdiv,
    check_float,
    check_launchable,
    emulate_bf16,
    is_interpreted,
    next_pow2,
    row_major,
)

FUSED_MAX_ROWS = 16  # the model fuses forwards of up to this many token rows (one BLOCK_M tile)
_BLOCK_M = 16  # the smallest tl.dot tile: rows past M are masked


@dataclass(frozen=True)
class FusedLinearConfig:
    block_n: int  # output columns per program (a power of 2 >= 16)
    block_k: int  # the K chunk (a power of 2 >= 16)
    num_warps: int = 4
    num_stages: int = 3


def fused_linear_config(n: int, k: int, dtype: torch.dtype) -> FusedLinearConfig:
    """From (N, K, dtype) only, never M (for :func:`norm_swiglu` N is the intermediate size: each
    program then reads two ``block_n``-row weight blocks). Narrow layers take 16 columns per program,
    so that SmolLM2's QKV (N = 960) spreads over 60 programs and its SwiGLU (I = 1,536) over 96, with
    K in chunks of 128 (half dtypes). Wide ones (N >= 8192: LM heads, 7B's projections) take 64 x 64:
    SmolLM2's LM head (49,152 x 576, bf16, M = 1) on the H200 took 19.7 us at 64 x 64 (cuBLAS 19.6),
    27.7 at 32 x 128 (2026-12-05, ``python -m specsched.bench.fused_linear --parts gemm``). The narrow
    defaults were 0.6-0.8 us behind the best config tried there (QKV 6.2 vs 5.6, gate/up 7.4 vs 6.6;
    which configs, the run did not keep): the next run of that benchmark tunes them."""
    half = dtype in (torch.float16, torch.bfloat16)
    is_wide = n >= 8192
    block_k = min(64 if is_wide or not half else 128, max(16, next_pow2(k)))
    block_n = min(64 if is_wide else 16, max(16, next_pow2(n)))
    return FusedLinearConfig(block_n, block_k, num_warps=4, num_stages=3 if half else 2)


def _check_same(op: str, name: str, t: torch.Tensor, shape: tuple, x: torch.Tensor, xname: str) -> None:
    """``t`` has ``shape`` and ``x``'s dtype and device."""
    if tuple(t.shape) != shape:
        dims = ", ".join(map(str, shape))
        raise ValueError(f"{op}: {name} must be [{dims}], got shape {tuple(t.shape)}")
    if t.dtype != x.dtype:
        raise ValueError(f"{op}: {name} dtype {t.dtype} differs from {xname} dtype {x.dtype}")
    if t.device != x.device:
        raise ValueError(f"{op}: {name} is on {t.device}, {xname} on {x.device}")


def _check_linear(op: str, x: torch.Tensor, xname: str, k: int, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"{op}: weight must be [N, K={k}], got shape {tuple(weight.shape)}")
    _check_same(op, "weight", weight, tuple(weight.shape), x, xname)


def _check_norm_prologue(op: str, x, residual, norm_weight) -> None:
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"{op}: x must be [M, K > 0], got shape {tuple(x.shape)}")
    check_float(op, "x", x)
    if residual is not None:
        _check_same(op, "residual", residual, tuple(x.shape), x, "x")
    _check_same(op, "norm_weight", norm_weight, (x.shape[1],), x, "x")


def _check_norm_linear(x, residual, norm_weight, weight, bias) -> None:
    op = "norm_linear"
    _check_norm_prologue(op, x, residual, norm_weight)
    _check_linear(op, x, "x", x.shape[1], weight)
    if bias is not None:
        _check_same(op, "bias", bias, (weight.shape[0],), x, "x")


def _check_norm_swiglu(x, residual, norm_weight, gate_up_weight) -> None:
    op = "norm_swiglu"
    _check_norm_prologue(op, x, residual, norm_weight)
    w = gate_up_weight
    if w.dim() != 2 or w.shape[1] != x.shape[1] or w.shape[0] % 2 != 0:
        raise ValueError(
            f"{op}: gate_up_weight must be [2 * intermediate, K={x.shape[1]}], got shape {tuple(w.shape)}"
        )
    _check_same(op, "gate_up_weight", w, tuple(w.shape), x, "x")


def _row_stride(t: torch.Tensor) -> int:
    """A single row's stride is never read: pass the row length, so it cannot make a new variant."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _dot_options(dtype: torch.dtype) -> dict:
    # fp32 keeps exact fp32 products (no tf32); under the interpreter half dtypes are upcast exactly
    upcast = dtype != torch.float32 and is_interpreted()
    return dict(PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
                EMULATE_BF16=emulate_bf16(dtype))  # fmt: skip


def _launch_norm(kernel, x, residual, norm_weight, eps, weight, bias_ptrs: tuple, n: int, config,
                 **constexprs):  # fmt: skip
    """Both norm kernels' launch: ``y`` [M, n] and the new residual, the (residual add +) RMSNorm
    arguments, then ``constexprs``. ``bias_ptrs``: the kernel's pointers between the weight and ``y``
    (``norm_linear``'s bias; None passes ``y``, unread)."""
    (m, k) = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_res = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else x
    if m == 0 or n == 0:
        if residual is not None:
            torch.add(x, residual, out=new_res)
        return y, new_res
    x, weight = row_major(x), row_major(weight)
    res = row_major(residual) if residual is not None else x
    cfg = config or fused_linear_config(n, k, x.dtype)
    kernel[(cdiv(m, _BLOCK_M), cdiv(n, cfg.block_n))](
        x, res, norm_weight.contiguous(), weight, *(y if b is None else b for b in bias_ptrs), y, new_res, m,
        _row_stride(x), _row_stride(res), weight.stride(0), y.stride(0), k, float(eps), 1.0 / k,
        K=k, HAS_RESIDUAL=residual is not None, BLOCK_M=_BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        **constexprs, **_dot_options(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **NO_FP_FUSION, **pdl_args(x.device, weight),
    )  # fmt: skip
    return y, new_res


def _launch_norm_linear(x, residual, norm_weight, eps, weight, bias, config):
    n = weight.shape[0]
    return _launch_norm(_norm_linear_kernel, x, residual, norm_weight, eps, weight, (bias,), n, config,
                        N=n, HAS_BIAS=bias is not None)  # fmt: skip


def _launch_norm_swiglu(x, residual, norm_weight, eps, weight, config):
    inter = weight.shape[0] // 2
    return _launch_norm(_norm_swiglu_kernel, x, residual, norm_weight, eps, weight, (), inter, config,
                        INTER=inter, LIBDEVICE_EXP=not is_interpreted())  # fmt: skip


def norm_linear_ref(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:  # y [M, N], new residual [M, K]
    """Torch reference: the unfused composition, ``add_rms_norm_ref`` (``rms_norm_ref`` without a
    residual, which is then ``x`` itself) and ``F.linear`` in the model dtype."""
    if residual is None:
        normed, new_res = rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, new_res = add_rms_norm_ref(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), new_res


def norm_linear_triton(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: FusedLinearConfig | None = None,  # tests and the benchmark only: another config
) -> tuple[torch.Tensor, torch.Tensor]:  # y [M, N], new residual [M, K] (x itself without a residual)
    """One launch; CUDA tensors (or CPU under ``TRITON_INTERPRET=1``); inputs are not modified."""
    _check_norm_linear(x, residual, norm_weight, weight, bias)
    check_launchable("norm_linear", x=x, weight=weight, norm_weight=norm_weight)
    return _launch_norm_linear(x, residual, norm_weight, eps, weight, bias, config)


def norm_linear(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:  # y [M, N], new residual [M, K] (x itself without a residual)
    """(Residual add +) RMSNorm + linear: the Triton kernel on CUDA (and under the interpreter), the
    torch reference elsewhere."""
    _check_norm_linear(x, residual, norm_weight, weight, bias)
    if x.is_cuda or is_interpreted():
        check_launchable("norm_linear", x=x, weight=weight, norm_weight=norm_weight)
        return _launch_norm_linear(x, residual, norm_weight, eps, weight, bias, None)
    return norm_linear_ref(x, residual, norm_weight, eps, weight, bias)


def norm_swiglu_ref(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    gate_up_weight: torch.Tensor,  # [2 * I, K]: [gate rows | up rows]
) -> tuple[torch.Tensor, torch.Tensor]:  # SwiGLU output [M, I], new residual [M, K]
    """Torch reference: ``silu_and_mul_ref(norm_linear_ref(...))``, the unfused composition."""
    gate_up, new_res = norm_linear_ref(x, residual, norm_weight, eps, gate_up_weight)
    return silu_and_mul_ref(gate_up), new_res


def norm_swiglu_triton(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    gate_up_weight: torch.Tensor,  # [2 * I, K]
    *,
    config: FusedLinearConfig | None = None,  # tests and the benchmark only: another config
) -> tuple[torch.Tensor, torch.Tensor]:  # [M, I], new residual [M, K] (x itself without a residual)
    """One launch; CUDA tensors (or CPU under ``TRITON_INTERPRET=1``); inputs are not modified."""
    _check_norm_swiglu(x, residual, norm_weight, gate_up_weight)
    check_launchable("norm_swiglu", x=x, gate_up_weight=gate_up_weight, norm_weight=norm_weight)
    return _launch_norm_swiglu(x, residual, norm_weight, eps, gate_up_weight, config)


def norm_swiglu(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    gate_up_weight: torch.Tensor,  # [2 * I, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # [M, I], new residual [M, K] (x itself without a residual)
    """(Residual add +) RMSNorm + gate/up projection + SwiGLU: the Triton kernel on CUDA (and under
    the interpreter), the torch reference elsewhere."""
    _check_norm_swiglu(x, residual, norm_weight, gate_up_weight)
    if x.is_cuda or is_interpreted():
        check_launchable("norm_swiglu", x=x, gate_up_weight=gate_up_weight, norm_weight=norm_weight)
        return _launch_norm_swiglu(x, residual, norm_weight, eps, gate_up_weight, None)
    return norm_swiglu_ref(x, residual, norm_weight, eps, gate_up_weight)
