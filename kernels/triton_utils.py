"""Shared pieces of the fused elementwise Triton kernels (``norm``, ``rotary``, ``activation``).

Rounding. The kernels compute in fp32 and round to the model dtype at the same points as their torch
references, so that results are bit-equal where the fp32 arithmetic is. Two things get in the way and
are handled here:

- FMA contraction: Triton fuses ``a * b + c`` into one ``fma`` by default, while torch's eager ops
  round every product. Every launch of these kernels passes :data:`NO_FP_FUSION`
  (``enable_fp_fusion=False``). The attention and batch-invariant matmul kernels pass
  :data:`FP_FUSION` instead: the contraction they were measured and bitwise-tested with on the H200,
  now explicit, so Triton 3.10's new default (fusion off) does not change their numerics.
- The Triton interpreter (``TRITON_INTERPRET=1``, triton 3.9) truncates fp32 -> bf16 casts instead of
  rounding to nearest even. :func:`round_to` emulates round-to-nearest-even with integer ops when the
  wrapper passes ``EMULATE_BF16`` (only under the interpreter; compiled kernels use the native cast).
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NO_FP_FUSION = {"enable_fp_fusion": False}  # launch kwarg: no a*b+c -> fma contraction
FP_FUSION = {"enable_fp_fusion": True}  # launch kwarg: Triton's default through 3.9, kept explicitly


def runtime_args(ints: tuple[str, ...] = (), pointers: tuple[str, ...] = ()) -> dict:
    """``triton.jit`` options that keep arguments whose values vary while serving out of the kernel's
    cache key, so they do not multiply its compiled variants (each new one is a compile in serving).

    Triton specialises an int argument on ``== 1`` and on divisibility by 16, and a pointer on 16-byte
    alignment. ``ints`` lose both (``do_not_specialize`` + ``do_not_specialize_on_alignment``);
    ``pointers`` lose the alignment one. Meant for metadata (block tables, lengths, slot maps: slices
    of one packed buffer whose alignment depends on the batch) and batch-dependent ints, where the
    specialisation buys nothing; not for the activation/weight tensors whose aligned loads matter.
    """
    params = inspect.signature(triton.jit).parameters
    out: dict = {}
    if ints and "do_not_specialize" in params:
        out["do_not_specialize"] = list(ints)
    if (ints or pointers) and "do_not_specialize_on_alignment" in params:
        out["do_not_specialize_on_alignment"] = [*ints, *pointers]
    return out


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (round to nearest, ties to even)."""
    if EMULATE_BF16:  # interpreter only: bf16 = top 16 bits of fp32 after adding the rounding bias
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host ints: ``triton.cdiv`` without its constexpr-function wrapper (~2 us a
    call in triton 3.6-3.9, several per launch in the wrappers: host time of every eager forward)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0): ``triton.next_power_of_2`` for host ints, without
    its wrapper (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def is_interpreted() -> bool:
    """True when Triton was imported with ``TRITON_INTERPRET=1`` (kernels run on CPU via numpy)."""
    return isinstance(round_to, InterpretedFunction)


def emulate_bf16(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and is_interpreted()


def check_launchable(op: str, **tensors: torch.Tensor) -> None:
    """The Triton launch needs CUDA tensors (or the interpreter), all on one device."""
    items = list(tensors.items())
    device = items[0][1].device
    if device.type != "cuda" and not is_interpreted():
        raise RuntimeError(
            f"{op}: the Triton kernel needs CUDA tensors, got {device}; call the public wrapper "
            f"(it runs the torch reference on CPU) or set TRITON_INTERPRET=1 before triton is imported"
        )
    for name, t in items[1:]:
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, {items[0][0]} on {device}")


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} must be float32/float16/bfloat16, got {t.dtype}")


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its last dimension is contiguous (rows may be strided), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # same shape as a, int64
    """Distance in units in the last place between same-dtype float tensors (0 = bit-equal, and
    +0 / -0 count as equal). For measuring kernels against their references in tests."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"ulp_distance needs equal dtypes/shapes, got {a.dtype}{tuple(a.shape)} "
                         f"and {b.dtype}{tuple(b.shape)}")  # fmt: skip
    bits = {torch.float32: 32, torch.float16: 16, torch.bfloat16: 16}.get(a.dtype)
    if bits is None:
        raise ValueError(f"ulp_distance: unsupported dtype {a.dtype}")
    int_dtype = torch.int32 if bits == 32 else torch.int16
    sign = 1 << (bits - 1)

    def ordered(x: torch.Tensor) -> torch.Tensor:  # sign-magnitude bits -> monotone integers
        u = x.contiguous().view(int_dtype).to(torch.int64) & ((1 << bits) - 1)
        return torch.where(u >= sign, -(u - sign), u)

    return (ordered(a) - ordered(b)).abs()


def diff_stats(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Max ulp distance, count of unequal elements, max abs and max relative error (vs |ref|, where
    |ref| > 0) of ``out`` against ``ref`` (same dtype and shape); NaNs must sit in the same places."""
    if not torch.equal(out.isnan(), ref.isnan()):
        raise AssertionError("NaNs differ between out and ref")
    o, r = out.nan_to_num(), ref.nan_to_num()
    ulps = ulp_distance(o, r)
    err = (o.double() - r.double()).abs()
    nz = r.double().abs() > 0
    rel = err[nz] / r.double().abs()[nz]
    return {
        "max_ulp": int(ulps.max()) if ulps.numel() else 0,
        "num_diff": int((ulps > 0).sum()),
        "numel": ulps.numel(),
        "max_abs": float(err.max()) if err.numel() else 0.0,
        "max_rel": float(rel.max()) if rel.numel() else 0.0,
    }


def num_warps_for(block: int) -> int:
    """Warps for a program that streams ``block`` elements (8 to 16 per thread at the top end)."""
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4 if block >= 512 else 1 if block <= 64 else 2
