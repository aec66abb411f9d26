"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (``model.pdl``).

On Hopper and later a kernel launched with the programmatic-serialization attribute (Triton's
``launch_pdl``) may be scheduled while the kernel before it in the stream (or CUDA graph) still runs.
Two PTX instructions govern it (``griddepcontrol``): ``wait`` blocks until the kernel before has
completed and its writes are visible, and ``launch_dependents`` lets the next kernel be scheduled
once every program of this one has executed it (or exited). A kernel here, launched with PDL:

1. prefetches into L2 what no kernel writes — the start of its weight rows — first;
2. lets its dependent start (``launch_dependents``);
3. waits (``wait``) before it reads or writes anything else.

So a launch-bound forward (SmolLM2 at batch 1: ~300 kernels of ~3 µs in one CUDA graph) fetches each
kernel's weights while the kernel before it runs. ``python -m specsched.bench.pdl_probe`` measured the
primitive on an H100 (2026-12-06): a 300-GEMV chain in a graph, 4.25 µs a kernel plain, 4.06 with PDL
and the wait first, 2.29 with the weights loaded before the wait (docs/benchmarks.md).

Safety: a kernel waits before touching anything a kernel before it in the stream may write or read,
so it neither reads early nor overwrites a buffer still being read; since each kernel's ``wait``
returns only once the kernel before it has completed, and that kernel itself waited for its own
predecessor, the ordering is transitive. Kernels without PDL (cuBLAS, torch ops) keep the full
stream order on both sides. Off by default (``model.pdl``); never under the Triton interpreter, on
the CPU or before compute capability 9.0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specsched.kernels.triton_utils import is_interpreted

__all__ = [
    "is_pdl_enabled", "pdl_args", "pdl_enabled", "pdl_start", "prefetch_l2", "prefetch_rows_l2", "set_pdl",
]  # fmt: skip
_state = {"on": False}
_capable: dict[int, bool] = {}


def set_pdl(on: bool) -> None:
    """Switch PDL launches on or off for the whole process (the model's loader does, from
    ``model.pdl``); kernels captured into a CUDA graph keep the mode they were captured with."""
    _state["on"] = bool(on)


def is_pdl_enabled() -> bool:
    return _state["on"]


class pdl_enabled:  # noqa: N801 (a context manager named like the setting it scopes)
    """``with pdl_enabled(True): ...``: the mode inside, the previous one restored after."""

    def __init__(self, on: bool) -> None:
        self.on, self.prev = bool(on), False

    def __enter__(self) -> None:
        self.prev = _state["on"]
        _state["on"] = self.on

    def __exit__(self, *exc) -> None:
        _state["on"] = self.prev


def _is_capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


def pdl_args(device: torch.device) -> dict:
    """Launch kwargs for a kernel with a ``USE_PDL`` constexpr: ``USE_PDL=True`` and ``launch_pdl``
    when PDL is on and ``device`` can run it, else ``USE_PDL=False`` (the kernel as before)."""
    on = _state["on"] and device.type == "cuda" and not is_interpreted() and _is_capable(device)
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


@triton.jit
def prefetch_l2(ptrs):
    """One ``prefetch.global.L2`` per element of ``ptrs`` (a hint: nothing waits for it). Compiled
    GPU kernels only: call it under ``if USE_PDL``."""
    return tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def prefetch_rows_l2(w_ptr, rows, num_rows, stride_w, K: tl.constexpr):
    """Prefetch into L2 the start of rows ``rows`` ``[R]`` (clamped to ``num_rows``) of a row-major
    ``[num_rows, K]`` matrix: its first 16 lines of 128 bytes (all of a bf16 row of K <= 1024), one
    prefetch a line. Only the start: what hides the stream's first latency, while the prefetches of
    every resident program together stay well inside L2 (a 7B GEMM's whole weight would not)."""
    LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements a line
    base = w_ptr + tl.minimum(rows, num_rows - 1)[:, None].to(tl.int64) * stride_w
    prefetch_l2(base + tl.minimum(tl.arange(0, 16) * LINE, K - 1)[None, :])


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """Steps 2 and 3 of the module docstring: let the next kernel start, then wait for the one before.
    Call it after the weights' loads or prefetches and before any other memory access."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
