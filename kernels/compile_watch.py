"""Counts Triton kernel variants built in this process, and those built after start-up.

A Triton kernel is compiled once per variant (its constexprs, dtypes and specialised arguments); a
variant first met while serving stalls that step by a compile (hundreds of ms) or, with a warm
on-disk cache, a load. The daemon builds every variant it can launch at start-up
(``specsched.engine.warmup``), then calls :meth:`CompileWatch.mark_ready`; any variant built after
that is counted in ``num_after_ready`` (the ``stats`` reply, the log's run row) and logged as a
warning naming the kernel and its signature, so a missing warm-up shape is found, not guessed.

The watch hooks Triton's JIT cache: ``triton.knobs.runtime.jit_cache_hook`` (Triton >= 3.4) or
``JITFunction.cache_hook`` (older), chaining any hook already there. It fires on every in-process
cache miss (a compile, or a load from Triton's on-disk cache). Under ``TRITON_INTERPRET=1`` and with
the torch backend nothing is compiled and the counts stay 0.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileEvent:
    kernel: str  # e.g. "_paged_attn_kernel"
    signature: str  # Triton's repr: launch options and the specialised argument types
    at: float  # time.time()
    is_after_ready: bool


class CompileWatch:
    """Process-wide counters of Triton variant builds (one instance: :func:`compile_watch`)."""

    def __init__(self, max_events: int = 256) -> None:
        self.num_built = 0
        self.num_after_ready = 0
        self.is_ready = False
        self.is_installed = False
        self.ready_at: float | None = None
        self.events: deque[CompileEvent] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._previous_hook = None

    def install(self) -> bool:
        """Hook Triton's JIT cache; False when Triton is not importable (nothing to count)."""
        with self._lock:
            if self.is_installed:
                return True
            try:
                import triton
            except ImportError:
                return False
            knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
            if knobs is not None and hasattr(knobs, "jit_cache_hook"):
                self._previous_hook = knobs.jit_cache_hook
                knobs.jit_cache_hook = self._hook
            else:  # Triton < 3.4
                from triton.runtime.jit import JITFunction

                self._previous_hook = JITFunction.cache_hook
                JITFunction.cache_hook = self._hook
            self.is_installed = True
            return True

    def mark_ready(self) -> None:
        """Start-up is over: from now on every variant built is counted and warned about."""
        with self._lock:
            self.is_ready, self.ready_at = True, time.time()

    def _hook(self, *args, **kwargs):
        fn, signature = kwargs.get("fn"), str(kwargs.get("repr", ""))
        name = getattr(fn, "name", None) or signature.split("[", 1)[0] or "?"
        with self._lock:
            self.num_built += 1
            after = self.is_ready
            self.num_after_ready += after
            self.events.append(CompileEvent(name, signature, time.time(), after))
        if after:
            logger.warning(
                "Triton kernel variant built after start-up (a serving stall; add its shape to the "
                "warm-up): %s (%d after start-up so far)", signature, self.num_after_ready,
            )  # fmt: skip
        if self._previous_hook is not None:
            return self._previous_hook(*args, **kwargs)
        return False  # never skip the compile

    def after_ready(self) -> list[CompileEvent]:
        with self._lock:
            return [e for e in self.events if e.is_after_ready]


_WATCH = CompileWatch()


def compile_watch() -> CompileWatch:
    """The process's watch, installed on first use."""
    _WATCH.install()
    return _WATCH
