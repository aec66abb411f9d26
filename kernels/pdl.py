"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (``model.pdl``).

On Hopper and later a kernel launched with the programmatic-serialization attribute (Triton's
``launch_pdl``) may be scheduled while the kernel before it in the stream (or CUDA graph) still runs.
Two PTX instructions govern it (``griddepcontrol``): ``wait`` blocks until the kernel before has
completed and its writes are visible, and ``launch_dependents`` lets the next kernel be scheduled
once every program of this one has executed it (or exited). A kernel here, launched with PDL:

1. prefetches into L2 what no kernel writes — the start of its weight rows — first, when its whole
   weight is small (at most ``prefetch_max_mb``: the latency-bound regime; a large GEMM streams at
   bandwidth anyway, and its prefetches would evict each other and the running kernel's data);
2. waits (``wait``) before it reads or writes anything else;
3. lets its dependent start (``launch_dependents``): after the wait by default (``trigger="after"``),
   so at most the next kernel is scheduled early, prefetching while this one runs; ``"before"``
   triggers ahead of the wait, which lets a chain of waiting kernels cascade onto the SMs.

So a launch-bound forward (SmolLM2 at batch 1: ~300 kernels of ~3 µs in one CUDA graph) fetches each
kernel's weights while the kernel before it runs. ``python -m specsched.bench.pdl_probe`` measured the
primitive on an H100 (2026-12-06): a 300-GEMV chain in a graph, 4.25 µs a kernel plain, 4.06 with PDL
and the wait first, 2.29 with the weights loaded before the wait (docs/benchmarks.md). On whole
forwards (``python -m specsched.bench.pdl_forward``, H100, same day, trigger before the wait, every
weight prefetched) SmolLM2's fused layers gained 9 % (998 -> 904 µs at M = 1), while the layers with
our own output / down GEMMs lost 7-25 % and every 7B path but the unfused one lost 12-52 %. With
the defaults above (H200, same day) the fused layers + own GEMMs gain 20 % (1,046 -> 835 µs at M = 1,
953 unfused); 7B's fused paths still lose 9-12 %. Through the daemon only 25 µs of SmolLM2's gain was
seen at batch 1 (bench=serve_pdl_ab): why is the next question (docs/benchmarks.md).

Safety: a kernel waits before touching anything a kernel before it in the stream may write or read,
so it neither reads early nor overwrites a buffer still being read; since each kernel's ``wait``
returns only once the kernel before it has completed, and that kernel itself waited for its own
predecessor, the ordering is transitive. Kernels without PDL (cuBLAS, torch ops) keep the full
stream order on both sides. Off by default (``model.pdl``); never under the Triton interpreter, on
the CPU or before compute capability 9.0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specsched.kernels.triton_utils import is_interpreted

__all__ = [
    "PdlMode", "is_pdl_enabled", "pdl_args", "pdl_enabled", "pdl_mode", "pdl_start", "prefetch_l2",
    "prefetch_rows_l2", "set_pdl",
]  # fmt: skip
TRIGGERS = ("after", "before")


@dataclass(frozen=True)
class PdlMode:
    """How the kernels launch: ``on`` (PDL at all), where each lets its dependent start (``trigger``:
    after or before its wait), and the largest whole weight (MB) whose rows it prefetches."""

    on: bool = False
    trigger: str = "after"
    prefetch_max_mb: float = 8.0

    def __post_init__(self) -> None:
        if self.trigger not in TRIGGERS:
            raise ValueError(f"PDL trigger must be one of {TRIGGERS}, got {self.trigger!r}")
        if self.prefetch_max_mb < 0:
            raise ValueError(f"PDL prefetch_max_mb must be >= 0, got {self.prefetch_max_mb}")


_state = {"mode": PdlMode()}
_OFF, _OFF_WEIGHTED = {"USE_PDL": False}, {"USE_PDL": False, "PREFETCH": False}
_capable: dict[int, bool] = {}


def set_pdl(on: bool | PdlMode) -> None:
    """Set the launch mode for the whole process (the model's loader does, from ``model.pdl``): a
    :class:`PdlMode`, or a bool for the default mode on / off. Kernels captured into a CUDA graph
    keep the mode they were captured with."""
    _state["mode"] = on if isinstance(on, PdlMode) else PdlMode(on=bool(on))


def pdl_mode() -> PdlMode:
    return _state["mode"]


def is_pdl_enabled() -> bool:
    return _state["mode"].on


class pdl_enabled:  # noqa: N801 (a context manager named like the setting it scopes)
    """``with pdl_enabled(True): ...`` (or a :class:`PdlMode`): that mode inside, the previous one
    restored after."""

    def __init__(self, on: bool | PdlMode) -> None:
        self.mode = on if isinstance(on, PdlMode) else PdlMode(on=bool(on))
        self.prev = PdlMode()

    def __enter__(self) -> None:
        self.prev = _state["mode"]
        _state["mode"] = self.mode

    def __exit__(self, *exc) -> None:
        _state["mode"] = self.prev


def _is_capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


def pdl_args(device: torch.device, weight: torch.Tensor | None = None) -> dict:
    """Launch kwargs for a kernel with ``USE_PDL`` and ``TRIGGER_FIRST`` constexprs (and, given its
    ``weight``, ``PREFETCH``): PDL when the mode is on and ``device`` can run it, else
    ``USE_PDL=False`` (the kernel as before)."""
    mode = _state["mode"]
    if not (mode.on and device.type == "cuda" and not is_interpreted() and _is_capable(device)):
        return _OFF if weight is None else _OFF_WEIGHTED  # shared: callers only unpack them
    out = {"USE_PDL": True, "TRIGGER_FIRST": mode.trigger == "before", "launch_pdl": True}
    if weight is not None:
        out["PREFETCH"] = weight.numel() * weight.element_size() <= mode.prefetch_max_mb * 2**20
    return out


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
    prefetch a line."""
    LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements a line
    base = w_ptr + tl.minimum(rows, num_rows - 1)[:, None].to(tl.int64) * stride_w
    prefetch_l2(base + tl.minimum(tl.arange(0, 16) * LINE, K - 1)[None, :])


@triton.jit
def pdl_start(USE_PDL: tl.constexpr, TRIGGER_FIRST: tl.constexpr):
    """Steps 2 and 3 of the module docstring, in the mode's order. Call it after the weights'
    prefetches and before any other memory access."""
    if USE_PDL:
        if TRIGGER_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        else:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
