"""Small-M linear layers with their elementwise prologue fused in: Triton kernels + torch references.

- :func:`norm_linear`: (residual add +) RMSNorm (Zhang & Sennrich, 2019, "Root Mean Square Layer
  Normalization") in the prologue of ``y = normed @ W.T (+ bias)``: a decoder layer's
  ``add_rms_norm`` -> QKV (or gate/up, or the final norm -> LM head) in one launch.
- :func:`silu_mul_linear`: SwiGLU (Shazeer, 2020, "GLU Variants Improve Transformer") in the
  prologue of the down projection: ``silu(gate) * up`` -> ``@ W_down.T`` in one launch.

Meant for decode/verify shapes (M <= :data:`FUSED_MAX_ROWS` token rows), where a step is bound by
launches and weight reads: rows are padded with masks to one 16-row ``tl.dot`` tile and each program
owns ``BLOCK_N`` output columns for the whole of K (no split-K, so no second launch). It walks K in
``BLOCK_K`` chunks, so K may be any size (8192 and more): ``norm_linear`` first sums the squares of
its rows (pass 1), then normalises each chunk and multiplies it with the weight chunk (pass 2). Every
program recomputes the row statistics (M x K elements, from L2) instead of exchanging them.

Rounding is the references' (:func:`~specsched.kernels.norm.add_rms_norm_ref`,
:func:`~specsched.kernels.activation.silu_and_mul_ref`): ``x + residual`` rounded to the model dtype,
fp32 statistics, the normalised row rounded, times the norm weight rounded again (SiLU rounded, times
``up`` rounded again); the product accumulates in fp32 and is rounded once (after the bias). Only the
accumulation order differs from cuBLAS / the CPU's GEMM. ``new_residual`` (``x + residual``) is written
by the programs of the first column block alone, bitwise as torch's add.

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
import triton

from specsched.kernels.activation import silu_and_mul_ref
from specsched.kernels.fused_linear_kernels import _norm_linear_kernel, _silu_mul_linear_kernel
from specsched.kernels.norm import add_rms_norm_ref, rms_norm_ref
from specsched.kernels.triton_utils import (
    NO_FP_FUSION,
    check_float,
    check_launchable,
    emulate_bf16,
    is_interpreted,
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
    """From (N, K, dtype) only, never M. Narrow layers take 16 columns per program, so that even
    SmolLM2's down projection (N = 576) spreads over 36 programs; wide ones (N >= 8192: LM heads, 7B's
    projections) 32. Not yet tuned on the H200 (``python -m specsched.bench.fused_linear``)."""
    half = dtype in (torch.float16, torch.bfloat16)
    block_k = min(128 if half else 64, max(16, triton.next_power_of_2(k)))
    block_n = min(32 if n >= 8192 else 16, max(16, triton.next_power_of_2(n)))
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


def _check_norm_linear(x, residual, norm_weight, weight, bias) -> None:
    op = "norm_linear"
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"{op}: x must be [M, K > 0], got shape {tuple(x.shape)}")
    check_float(op, "x", x)
    if residual is not None:
        _check_same(op, "residual", residual, tuple(x.shape), x, "x")
    _check_same(op, "norm_weight", norm_weight, (x.shape[1],), x, "x")
    _check_linear(op, x, "x", x.shape[1], weight)
    if bias is not None:
        _check_same(op, "bias", bias, (weight.shape[0],), x, "x")


def _check_silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> None:
    op = "silu_mul_linear"
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 != 0:
        raise ValueError(f"{op}: gate_up must be [M, 2 * intermediate], got shape {tuple(gate_up.shape)}")
    check_float(op, "gate_up", gate_up)
    _check_linear(op, gate_up, "gate_up", gate_up.shape[1] // 2, weight)


def _row_stride(t: torch.Tensor) -> int:
    """A single row's stride is never read: pass the row length, so it cannot make a new variant."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _dot_options(dtype: torch.dtype) -> dict:
    # fp32 keeps exact fp32 products (no tf32); under the interpreter half dtypes are upcast exactly
    upcast = dtype != torch.float32 and is_interpreted()
    return dict(PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
                EMULATE_BF16=emulate_bf16(dtype))  # fmt: skip


def _launch_norm_linear(x, residual, norm_weight, eps, weight, bias, config):
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_res = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else x
    if m == 0 or n == 0:
        if residual is not None:
            torch.add(x, residual, out=new_res)
        return y, new_res
    x, weight = row_major(x), row_major(weight)
    res = row_major(residual) if residual is not None else x
    cfg = config or fused_linear_config(n, k, x.dtype)
    _norm_linear_kernel[(triton.cdiv(m, _BLOCK_M), triton.cdiv(n, cfg.block_n))](
        x, res, norm_weight.contiguous(), weight, bias if bias is not None else y, y, new_res, m,
        _row_stride(x), _row_stride(res), weight.stride(0), y.stride(0), k, float(eps), 1.0 / k,
        N=n, K=k, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_M=_BLOCK_M,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **_dot_options(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **NO_FP_FUSION,
    )  # fmt: skip
    return y, new_res


def _launch_silu_mul_linear(gate_up, weight, config):
    m, inter, n = gate_up.shape[0], gate_up.shape[1] // 2, weight.shape[0]
    y = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    if m == 0 or n == 0 or inter == 0:
        return y.zero_()
    g, weight = row_major(gate_up), row_major(weight)
    cfg = config or fused_linear_config(n, inter, g.dtype)
    _silu_mul_linear_kernel[(triton.cdiv(m, _BLOCK_M), triton.cdiv(n, cfg.block_n))](
        g, weight, y, m, _row_stride(g), weight.stride(0), y.stride(0),
        N=n, INTER=inter, BLOCK_M=_BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        LIBDEVICE_EXP=not is_interpreted(), **_dot_options(g.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **NO_FP_FUSION,
    )  # fmt: skip
    return y


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


def silu_mul_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, 2I], [N, I]
    """Torch reference: ``F.linear(silu_and_mul_ref(gate_up), weight)`` in the model dtype -> [M, N]."""
    return F.linear(silu_and_mul_ref(gate_up), weight)


def silu_mul_linear_triton(
    gate_up: torch.Tensor,  # [M, 2 * I]: [gate | up]
    weight: torch.Tensor,  # [N, I]
    *,
    config: FusedLinearConfig | None = None,  # tests and the benchmark only: another config
) -> torch.Tensor:  # [M, N]
    """One launch; CUDA tensors (or CPU under ``TRITON_INTERPRET=1``)."""
    _check_silu_mul_linear(gate_up, weight)
    check_launchable("silu_mul_linear", gate_up=gate_up, weight=weight)
    return _launch_silu_mul_linear(gate_up, weight, config)


def silu_mul_linear(
    gate_up: torch.Tensor,  # [M, 2 * I]: [gate | up]
    weight: torch.Tensor,  # [N, I]
) -> torch.Tensor:  # [M, N]
    """SwiGLU + down projection: the Triton kernel on CUDA (and under the interpreter), the torch
    reference elsewhere."""
    _check_silu_mul_linear(gate_up, weight)
    if gate_up.is_cuda or is_interpreted():
        check_launchable("silu_mul_linear", gate_up=gate_up, weight=weight)
        return _launch_silu_mul_linear(gate_up, weight, None)
    return silu_mul_linear_ref(gate_up, weight)
