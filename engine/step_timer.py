"""Phase times of an engine step (propose, score, verify) without host/GPU syncs.

On the host (CPU device) a phase's time is its ``time.perf_counter`` wall time, added to the step
record's field when the phase ends.

On CUDA each phase records an event when it starts and when it ends (a small pool of timing events,
reused every step: nothing is allocated per step once the pool has grown to the step's phases; a
phase entered with ``is_adjacent``, no device work queued since the phase before, starts at that
phase's end event instead of a record of its own: each record lets the other threads take the
interpreter lock), and
the elapsed times are read in :meth:`StepTimer.finish`, after the step's one host read (verification
copies its result to the host, which waits for the GPU) — so timing adds no sync point to the step.
A phase's time is the stream time between its two events: when the GPU is idle at the phase's start
(the usual case: the previous step ended with the host read), its start event fires at once and the
phase is charged its host work plus the GPU work it queued, exactly what the former
``synchronize``-bracketed timer measured; when the GPU is still busy with an earlier phase, the start
event fires when that work is done, so the phase is charged only its own GPU work and the part of
its host work that the GPU waited for. The score phase's time is therefore the GPU time of the
scoring forward (plus its unhidden input preparation), as the cost models expect. The phases are
disjoint intervals of the stream's timeline inside the step, so their sum never exceeds the step's
wall time. The verify phase's block only queues the verification behind the forward (its events
time that device work); the host reads the result later (:meth:`mark_tail` charges the read's host
time to the phase). :meth:`finish` checks each end event with ``query`` (no wait) and waits only when
the GPU has not reached it yet (counted in ``num_waits``; it should stay 0).

``host_ms`` keeps the current step's host (perf_counter) time per phase on both devices: the timed
phases' blocks, plus the untimed stretches between them charged by :meth:`StepTimer.mark` to a named
phase (schedule, view, decide, ...; time between a mark and the next block goes to ``other``). On
CUDA a block's host time is its Python time, not the GPU's, except where the block waits for the GPU
(verify's host read).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specsched.engine.records import StepRecord


class StepTimer:
    """Times the phases of one step at a time; use as ``with timer.phase(rec, "score_ms"): ...``
    between :meth:`start_step` and :meth:`finish`. Phases do not nest."""

    def __init__(self, device: torch.device | str, event_factory: Callable[[], object] | None = None) -> None:
        """``event_factory`` makes a timing event (``record``/``query``/``synchronize``/
        ``elapsed_time`` like ``torch.cuda.Event(enable_timing=True)``, the default on CUDA); given
        one, the event path runs on any device (tests)."""
        self.is_events = event_factory is not None or torch.device(device).type == "cuda"
        self._new_event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._pool: list[object] = []  # the events of a step's phases, reused every step
        self._num_used = 0  # events of the pool this step has recorded
        self._pending: list[list] = []  # [field, start event, end event] of this step's phases
        self._is_adjacent = False
        self.host_ms: dict[str, float] = {}  # perf_counter ms per phase of the current step
        self.num_waits = 0  # finish() found an end event not yet reached and waited for it
        self._rec: StepRecord | None = None
        self._field = ""
        self._t0 = 0.0
        self._lap = 0.0  # perf_counter at the last mark or block end

    def start_step(self, t0: float | None = None) -> None:
        """Begin a step; ``t0``: its perf_counter start, when work before this call belongs to it."""
        self.host_ms.clear()
        self._pending.clear()
        self._num_used = 0
        self._lap = time.perf_counter() if t0 is None else t0

    def mark(self, name: str) -> None:
        """Charge the host time since the last mark or block end to phase ``name``."""
        now = time.perf_counter()
        self.host_ms[name] = self.host_ms.get(name, 0.0) + (now - self._lap) * 1e3
        self._lap = now

    def mark_tail(self, rec: StepRecord, field: str) -> None:
        """Charge the host time since the last mark to the timed phase ``field`` (e.g. ``verify_ms``):
        the host end of a phase whose device work was queued in its block earlier (the read of its
        result). On the host path the record's field gets the time too (a phase's time is its host
        time there); on CUDA the block's events timed the device work."""
        now = time.perf_counter()
        ms = (now - self._lap) * 1e3
        self._lap = now
        name = field.removesuffix("_ms")
        self.host_ms[name] = self.host_ms.get(name, 0.0) + ms
        if not self.is_events:
            setattr(rec, field, getattr(rec, field) + ms)

    def phase(self, rec: StepRecord, field: str, is_adjacent: bool = False) -> StepTimer:
        """Context manager adding the enclosed block's time to ``rec.<field>`` (ms). ``is_adjacent``:
        the block follows the step's previous phase with no device work queued between the two, so
        on CUDA it starts at that phase's end event (one record, one release of the interpreter
        lock, fewer a step)."""
        self._rec, self._field, self._is_adjacent = rec, field, is_adjacent
        return self

    def _event(self) -> object:
        """The next event of the pool (made on first use)."""
        if self._num_used == len(self._pool):
            self._pool.append(self._new_event())
        self._num_used += 1
        return self._pool[self._num_used - 1]

    def __enter__(self) -> None:
        self.mark("other")
        if self.is_events:
            if self._is_adjacent and self._pending:
                self._pending.append([self._field, self._pending[-1][2], None])
            else:
                is_first = not self._pending
                start = self._event()
                start.record()
                self._pending.append([self._field, start, None])
                # the record calls apart: each lets the other threads take the GIL; the step's first
                # apart again: the first release of the lock in a step is where work the other
                # threads were given since the last step (outputs to send, log records) lands
                self.mark("first_event" if is_first else "events")
        self._t0 = self._lap

    def __exit__(self, *exc) -> None:
        self._lap = time.perf_counter()
        ms = (self._lap - self._t0) * 1e3
        field = self._field
        name = field.removesuffix("_ms")
        self.host_ms[name] = self.host_ms.get(name, 0.0) + ms
        if self.is_events:
            end = self._pending[-1][2] = self._event()
            end.record()
            self.mark("events")
        else:
            setattr(self._rec, field, getattr(self._rec, field) + ms)

    def finish(self, rec: StepRecord) -> None:
        """Add the event-timed phases of this step to ``rec`` (no-op on the host path). Call after
        the step's host read, which has waited for the device work of every phase."""
        for field, start, end in self._pending:
            if not end.query():
                self.num_waits += 1
                end.synchronize()
            setattr(rec, field, getattr(rec, field) + start.elapsed_time(end))
        self._pending.clear()
