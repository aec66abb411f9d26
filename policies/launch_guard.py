"""Which decode steps' measured times the cost models should not learn: those whose scoring launch the
host was slow to issue.

On CUDA a step's score ms runs from an event recorded before the scoring forward's input preparation
to one after the forward (engine/step_timer.py): the GPU idles while the host prepares the inputs, so
the score phase includes the host time of the launch, ~0.24 ms of SmolLM2's ~1.05 ms at batch 1 on the
H100. When the host is busy with something else (another thread holding the interpreter lock, the OS)
that launch takes several times as long and the step's score ms carries the delay: in goodput's serve
log of 2026-12-06 14:12 (H100) the 9-token MQA graph at batch 1 had a median score of 1.055 ms, while
its steps in two slow stretches took 1.4-5.8 ms with launches of 0.6-5.1 ms against 0.24. Below the
stall guard's 4x (policies/cost_model.py, ``STALL_RATIO``) those steps were learnt: the graph's
residual (policies/bucket_bias.py) rose to 1.78 ms and goodput drafted 3 or 7 of 8 offered drafts for
the rest of the run, into graphs it had happened to see at quiet times, though the 9-token graph
costs the same step there. Replayed through the cost models (dev CPU, the log's 16,476 decode steps),
the predicted score gap between k = 8 and k = 3 at batch 1 averaged 0.55 ms over the run; skipping
the steps whose launch took over twice its running typical value (2.8 % of them) brought it to 0.07,
and with the residual winsorized, to 0.02 (measured: ~0.01; ``python -m specsched.bench.cost_replay``).

:class:`LaunchGuard` keeps, per (scorer, batch size), an exponential mean of the launch's host ms over
every step (disturbed ones too, slowly: a host that became slower for good moves it past half the new
level within ~15 steps, and its steps are learnt again); a step whose launch exceeds ``ratio`` times
that mean is *disturbed*: it teaches the models nothing (its error still counts), as a stall.
"""

from __future__ import annotations

__all__ = ["LaunchGuard"]


class LaunchGuard:
    """Running typical launch ms per (scorer, batch size); :meth:`is_disturbed` per step."""

    def __init__(self, ratio: float = 2.0, rate: float = 0.02) -> None:
        if not ratio > 1.0 or not 0.0 < rate <= 1.0:
            raise ValueError(f"need ratio > 1 and 0 < rate <= 1, got ratio={ratio}, rate={rate}")
        self.ratio, self.rate = ratio, rate
        self.typical: dict[tuple[str, int], float] = {}  # (scorer, batch size) -> launch ms
        self.num_disturbed = 0

    def is_disturbed(self, scorer: str, batch_size: int, launch_ms: float | None) -> bool:
        """Whether a step of ``scorer`` at ``batch_size`` whose scoring launch took ``launch_ms`` of host
        time (None: not timed, e.g. the CPU path, where the score phase is the forward itself) was
        disturbed; updates the typical value either way."""
        if launch_ms is None:
            return False
        key = (scorer, batch_size)
        typical = self.typical.get(key)
        if typical is None:
            self.typical[key] = launch_ms
            return False
        self.typical[key] = typical + (launch_ms - typical) * self.rate
        if launch_ms > self.ratio * typical:
            self.num_disturbed += 1
            return True
        return False
