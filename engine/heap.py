"""The collector's view of a long-running server's heap.

CPython's cyclic garbage collector scans, in a full (generation-2) pass, every tracked object alive:
after start-up that is the model's modules and parameters' wrappers, the tokenizer, torch, Triton
and every imported module (~236k objects with SmolLM2 loaded). A full pass over them took 125 ms on
the 2-core dev machine; under load at batch 64 one comes every few seconds, a stall of one step each
that moves tok/s between identical passes and the ITL p99. :func:`freeze_heap` moves everything
alive at start-up into the permanent generation (``gc.freeze``, Python 3.7+), so full passes scan
only what serving itself allocates; the frozen objects are never collected (they live as long as
the daemon anyway). Call it once, after warm-up, before serving.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass


@dataclass
class FrozenHeap:
    num_frozen: int  # objects moved to the permanent generation
    seconds: float  # the collection before the freeze, and the freeze

    @property
    def description(self) -> str:
        return f"{self.num_frozen} start-up objects frozen out of the GC's passes in {self.seconds:.2f} s"


def freeze_heap() -> FrozenHeap:
    """Collect what start-up left as garbage, then freeze the rest (see the module docstring)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return FrozenHeap(gc.get_freeze_count(), time.perf_counter() - t0)
