"""SwiGLU (``silu(gate) * up``) over the fused gate/up GEMM output: Triton kernel + torch reference.

SwiGLU (Shazeer, 2020, "GLU Variants Improve Transformer"): ``silu(g) * u`` with
``silu(g) = g / (1 + exp(-g))`` (Elfwing et al., 2017). The fused ``gate_up_proj`` GEMM writes
``[gate | up]`` along the last dimension; the kernel reads both halves and writes ``[T, I]`` in one
launch. Rounding follows ``F.silu(gate) * up`` in the model dtype: silu in fp32 rounded to the dtype,
then the product in fp32 rounded again. On the GPU the exponential is libdevice's ``expf`` and the
division is IEEE round-to-nearest, as in torch's CUDA silu kernel (Triton's default ``exp`` and
``/`` are faster approximations).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from specsched.kernels.pdl import pdl_args, pdl_start
from specsched.kernels.triton_utils import (
    NO_FP_FUSION,
    cdiv,
    check_float,
    check_launchable,
    emulate_bf16,
    is_interpreted,
    next_pow2,
    round_to,
    row_major,
)

_BLOCK = 1024  # output columns per program (8 per thread at 4 warps: 16-byte bf16 accesses)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
    """Torch reference: ``F.silu(gate) * up`` in the model dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o,
    INTER: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, EMULATE_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False, TRIGGER_FIRST: tl.constexpr = False,
):  # fmt: skip
    pdl_start(USE_PDL, TRIGGER_FIRST)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    dtype = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        e = libdevice.exp(-g)
    else:  # the interpreter has no libdevice
        e = tl.exp(-g)
    act = round_to(tl.math.div_rn(g, 1.0 + e), dtype, EMULATE_BF16).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, round_to(act * u, dtype, EMULATE_BF16), mask=mask)


def _check(gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 != 0:
        raise ValueError(
            f"silu_and_mul: gate_up must be [num_tokens, 2 * intermediate], got shape {tuple(gate_up.shape)}"
        )
    check_float("silu_and_mul", "gate_up", gate_up)


def _launch(gate_up: torch.Tensor) -> torch.Tensor:
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or inter == 0:
        return out
    x = row_major(gate_up)
    block = min(_BLOCK, next_pow2(inter))
    _silu_and_mul_kernel[(t, cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0),
        INTER=inter, BLOCK=block, LIBDEVICE_EXP=not is_interpreted(), EMULATE_BF16=emulate_bf16(x.dtype),
        num_warps=4 if block >= 512 else 1, **NO_FP_FUSION, **pdl_args(x.device),
    )  # fmt: skip
    return out


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
    """One launch over (token, column block); CUDA tensors (or CPU under ``TRITON_INTERPRET=1``)."""
    _check(gate_up)
    check_launchable("silu_and_mul", gate_up=gate_up)
    return _launch(gate_up)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
    """SwiGLU over ``[gate | up]``: the Triton kernel on CUDA, the torch reference elsewhere."""
    _check(gate_up)
    if gate_up.is_cuda:
        return _launch(gate_up)
    return silu_and_mul_ref(gate_up)
