"""RMSNorm and fused residual-add + RMSNorm: Triton kernels with their torch references.

RMSNorm (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization"): for a row x of width H,
``y = w * x / sqrt(mean(x^2) + eps)``. Rounding follows the Llama reference exactly: the
normalisation runs in fp32, the normalised row is rounded to the model dtype, and the product with
the weight (model dtype) is rounded once more. The fused variant first forms the new residual
stream ``x + residual`` in the model dtype (one rounding, as torch's add) and normalises that, so a
decoder layer's residual add costs no extra launch.

Both kernels take one program per token row (``BLOCK`` = next power of two of H), so a launch
depends only on shapes and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specsched.kernels.pdl import pdl_args, pdl_start, prefetch_rows_l2
from specsched.kernels.triton_utils import (
    NO_FP_FUSION,
    check_float,
    check_launchable,
    emulate_bf16,
    next_pow2,
    num_warps_for,
    round_to,
    row_major,
)


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], same dtype as x
    eps: float,
) -> torch.Tensor:  # [T, H]
    """Torch reference (the Llama formulation): fp32 statistics, two roundings to ``x.dtype``."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, H], new residual [T, H]
    """Torch reference: ``new_residual = x + residual`` (model dtype), ``normed = rms_norm(new_residual)``."""
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro, eps, inv_h,
    H: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False, TRIGGER_FIRST: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    dtype = out_ptr.dtype.element_ty
    if USE_PDL and PREFETCH:  # the weight first: no kernel writes it
        prefetch_rows_l2(w_ptr, tl.arange(0, 1), 1, H, H)
    pdl_start(USE_PDL, TRIGGER_FIRST)
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = round_to(x + r, dtype, EMULATE_BF16)
        tl.store(res_out_ptr + t * stride_ro + offs, s, mask=mask)
        x = s.to(tl.float32)
    # mean as torch's CUDA reduction forms it: sum * fl(1/H)
    var = tl.sum(x * x, 0) * inv_h
    xn = round_to(x * tl.rsqrt(var + eps), dtype, EMULATE_BF16).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, round_to(w * xn, dtype, EMULATE_BF16), mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    num_tokens, hidden = x.shape
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    res_out = None
    if residual is not None:
        res_out = torch.empty_like(out) if residual_out is None else residual_out
    if num_tokens == 0:
        return out, res_out
    x = row_major(x)
    res = row_major(residual) if residual is not None else x
    ro = res_out if res_out is not None else out
    block = next_pow2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight.contiguous(), out, ro, x.stride(0), res.stride(0), out.stride(0), ro.stride(0),
        float(eps), 1.0 / hidden,
        H=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, EMULATE_BF16=emulate_bf16(x.dtype),
        num_warps=num_warps_for(block), **NO_FP_FUSION, **pdl_args(x.device, weight),
    )  # fmt: skip
    return out, res_out


_MAX_HIDDEN = 32768  # one program holds a whole row in registers


def _check(op: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
    if x.shape[1] > _MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size {x.shape[1]} exceeds the supported {_MAX_HIDDEN}")
    check_float(op, "x", x)
    if weight.shape != (x.shape[1],):
        raise ValueError(f"{op}: weight must be [hidden={x.shape[1]}], got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"{op}: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"{op}: weight is on {weight.device}, x on {x.device}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(
                f"{op}: residual must have x's shape {tuple(x.shape)}, got shape {tuple(residual.shape)}"
            )
        if residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual dtype {residual.dtype} differs from x dtype {x.dtype}")
        if residual.device != x.device:
            raise ValueError(f"{op}: residual is on {residual.device}, x on {x.device}")


def rms_norm_triton(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H]
    """One launch, one program per row; CUDA tensors (or CPU under ``TRITON_INTERPRET=1``)."""
    _check("rms_norm", x, weight)
    check_launchable("rms_norm", x=x, weight=weight)
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    *,
    residual_out: torch.Tensor | None = None,  # [T, H], rows contiguous: the new residual written here
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, H], new residual [T, H]
    """One launch: writes ``x + residual`` and its RMSNorm; inputs are not modified."""
    _check("add_rms_norm", x, weight, residual)
    check_launchable("add_rms_norm", x=x, residual=residual, weight=weight)
    if residual_out is not None:
        _check_out("add_rms_norm", "residual_out", residual_out, x)
    out, res_out = _launch(x, residual, weight, eps, residual_out)
    assert res_out is not None
    return out, res_out


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], same dtype as x
    eps: float,
) -> torch.Tensor:  # [T, H]
    """RMSNorm: the Triton kernel on CUDA, the torch reference elsewhere."""
    _check("rms_norm", x, weight)
    if x.is_cuda:
        return _launch(x, None, weight, eps)[0]
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H], same dtype as x
    eps: float,
    *,
    residual_out: torch.Tensor | None = None,  # [T, H], rows contiguous: the new residual written here
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, H], new residual = x + residual [T, H]
    """Residual add fused with RMSNorm: the Triton kernel on CUDA, the torch reference elsewhere.
    ``residual_out`` (not aliasing ``x`` or ``residual``) receives the new residual, e.g. a static
    buffer that a later CUDA graph reads (models/piecewise_graphs.py)."""
    _check("add_rms_norm", x, weight, residual)
    if residual_out is not None:
        _check_out("add_rms_norm", "residual_out", residual_out, x)
    if x.is_cuda:
        out, res_out = _launch(x, residual, weight, eps, residual_out)
        assert res_out is not None
        return out, res_out
    normed, new_residual = add_rms_norm_ref(x, residual, weight, eps)
    if residual_out is None:
        return normed, new_residual
    return normed, residual_out.copy_(new_residual)


def _check_out(op: str, name: str, out: torch.Tensor, like: torch.Tensor) -> None:
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"{op}: {name} must be {tuple(like.shape)} {like.dtype} on {like.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must be contiguous in its last dimension")
