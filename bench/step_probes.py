"""The probes of bench/step_overhead.py: the bench's clock, the forward's time (and a clock that stands
still inside it, for cProfile), host time per engine phase, and counters of the host's would-be kernel
launches, host-to-device copies and host reads outside the forward."""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from specsched.engine.engine import Engine
from specsched.engine.records import StepRecord


class _Clock:
    """The bench's clock: thread CPU time by default (``--clock cpu``: other processes on the machine
    do not inflate it; the forward runs on this thread with ``--threads 1``), or wall time."""

    now = staticmethod(time.thread_time)


CLOCK = _Clock()


class ForwardClock:
    """Times every call of a model's ``forward``; :meth:`host_clock` is a clock that stands still
    inside the forward (cProfile's timer: every cumulative time it reports is host time)."""

    def __init__(self) -> None:
        self.total_s, self.num_calls, self._depth, self._entered = 0.0, 0, 0, 0.0

    def wrap(self, model: torch.nn.Module) -> None:
        inner = model.forward

        def forward(*args, **kwargs):
            self._depth += 1
            if self._depth == 1:
                self._entered = CLOCK.now()
            try:
                return inner(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.total_s += CLOCK.now() - self._entered
                    self.num_calls += 1

        model.forward = forward  # nn.Module.__call__ looks the instance attribute up first

    def host_clock(self) -> float:
        now = self._entered if self._depth else CLOCK.now()
        return now - self.total_s


class Phases:
    """Host seconds per phase of the current step: time in wrapped methods, or in the engine's own
    timed blocks (propose, score, verify), minus the forwards inside."""

    def __init__(self, clock: ForwardClock) -> None:
        self.clock, self.host_s = clock, defaultdict(float)

    def wrap_engine_timer(self, engine: Engine) -> None:
        inner, phases = engine._timed, self

        class Block:
            def __init__(self, rec: StepRecord, field: str, is_adjacent: bool = False) -> None:
                self.block, self.phase = inner(rec, field, is_adjacent), field.removesuffix("_ms")

            def __enter__(self) -> None:
                self.block.__enter__()
                self.t0, self.f0 = CLOCK.now(), phases.clock.total_s

            def __exit__(self, *exc) -> None:
                dt = CLOCK.now() - self.t0 - (phases.clock.total_s - self.f0)
                phases.host_s[self.phase] += dt
                self.block.__exit__(*exc)

        engine._timed = Block

    def wrap(self, obj: object, method: str, phase: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            t0, f0 = CLOCK.now(), self.clock.total_s
            try:
                return inner(*args, **kwargs)
            finally:
                self.host_s[phase] += CLOCK.now() - t0 - (self.clock.total_s - f0)

        setattr(obj, method, timed)


class OpCounter(TorchDispatchMode):
    """Counts, outside the forward, the aten ops that would launch a kernel on a GPU (non-view ops),
    with :class:`TransferCounter` beside it."""

    _NOT_LAUNCHES = (
        "aten.detach_.default",
        "aten.detach.default",
        "aten.item.default",
        "aten.lift_fresh.default",
    )

    def __init__(self, clock: ForwardClock) -> None:
        super().__init__()
        self.clock, self.num_launches = clock, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.clock._depth and not func.is_view and str(func) not in self._NOT_LAUNCHES:
            self.num_launches += 1
        return func(*args, **(kwargs or {}))


class TransferCounter(TorchFunctionMode):
    """Counts, outside the forward, ``.to(device)`` calls (a host-to-device copy when the data is on
    the host: an upper bound on a CPU run) and reads of tensor values on the host (``tolist``,
    ``item``, ``int``/``float``/``bool``, ``numpy``: each waits for the device when the tensor is
    on it)."""

    _SYNCS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy")

    def __init__(self, clock: ForwardClock) -> None:
        super().__init__()
        self.clock, self.num_copies, self.num_syncs = clock, 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.clock._depth:
            name = getattr(func, "__name__", "")
            targets = (*args[1:], *(kwargs or {}).values())
            if name == "to" and any(isinstance(a, (str, torch.device)) for a in targets):
                self.num_copies += 1
            elif name in self._SYNCS:
                self.num_syncs += 1
        return func(*args, **(kwargs or {}))
