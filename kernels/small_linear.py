"""A plain small-M linear layer, ``y = x @ W.T (+ bias)``, in the kernel family of
:mod:`specsched.kernels.fused_linear` (the same tiles, launch configs and rounding, no prologue).

For the GEMMs of a decoder layer that have no elementwise op to fuse in front of them, the attention
output projection and the down projection: at M <= 16 cuBLAS may split K over several programs and
add a reduction kernel after the GEMM, a second launch. Here each program owns ``BLOCK_N`` output
columns over the whole of K (one launch), and row i of ``y`` is bitwise independent of M and of the
other rows, as for the fused kernels. Whether it beats cuBLAS on the H200 is what
``python -m specsched.bench.fused_linear --parts gemm`` measures (``model.fused_linear_gemms``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specsched.kernels.fused_linear import (
    FUSED_MAX_ROWS,
    FusedLinearConfig,
    _check_linear,
    _check_same,
    _dot_options,
    _row_stride,
    fused_linear_config,
)
from specsched.kernels.fused_linear_kernels import _small_linear_kernel
from specsched.kernels.pdl import pdl_args
from specsched.kernels.triton_utils import (
    NO_FP_FUSION,
    cdiv,
    check_float,
    check_launchable,
    is_interpreted,
    row_major,
)

__all__ = ["small_linear", "small_linear_ref", "small_linear_triton"]
_BLOCK_M = FUSED_MAX_ROWS  # one tl.dot tile of rows


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    op = "small_linear"
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"{op}: x must be [M, K > 0], got shape {tuple(x.shape)}")
    check_float(op, "x", x)
    _check_linear(op, x, "x", x.shape[1], weight)
    if bias is not None:
        _check_same(op, "bias", bias, (weight.shape[0],), x, "x")


def _launch(x, weight, bias, config: FusedLinearConfig | None) -> torch.Tensor:
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    x, weight = row_major(x), row_major(weight)
    cfg = config or fused_linear_config(n, k, x.dtype)
    _small_linear_kernel[(cdiv(m, _BLOCK_M), cdiv(n, cfg.block_n))](
        x, weight, bias if bias is not None else y, y, m, _row_stride(x), weight.stride(0), y.stride(0),
        N=n, K=k, HAS_BIAS=bias is not None, BLOCK_M=_BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        **_dot_options(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **NO_FP_FUSION,
        **pdl_args(x.device, weight),
    )  # fmt: skip
    return y


def small_linear_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """Torch reference: ``F.linear`` in the model dtype."""
    return F.linear(x, weight, bias)


def small_linear_triton(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: FusedLinearConfig | None = None,  # tests and the benchmark only: another config
) -> torch.Tensor:  # [M, N]
    """One launch; CUDA tensors (or CPU under ``TRITON_INTERPRET=1``); any M (rows past the first 16
    take further row tiles)."""
    _check(x, weight, bias)
    check_launchable("small_linear", x=x, weight=weight)
    return _launch(x, weight, bias, config)


def small_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """The Triton kernel on CUDA (and under the interpreter), the torch reference elsewhere."""
    _check(x, weight, bias)
    if x.is_cuda or is_interpreted():
        check_launchable("small_linear", x=x, weight=weight)
        return _launch(x, weight, bias, None)
    return small_linear_ref(x, weight, bias)
