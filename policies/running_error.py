"""The running (prequential) error of a cost model's step predictions."""

from __future__ import annotations

import math


class RunningError:
    """Exponentially weighted means of the prequential relative error of step predictions: of its
    size (``value``: |predicted − measured| / measured) and of its sign (``bias``: (predicted −
    measured) / measured). Step-to-step noise adds to the size but averages out of the bias, which
    is what a cost model that no longer fits the machine (a step change in costs) shows.

    Each update moves a mean 1/``window`` of the way to the new step's error (a memory of about
    ``window`` steps), after plain means over the first ``window`` steps so the start is not pulled
    towards 0. Both are None until ``min_count`` steps were seen.
    """

    def __init__(self, window: int = 16, min_count: int = 4) -> None:
        if window < 1 or min_count < 1:
            raise ValueError(f"RunningError needs window >= 1 and min_count >= 1, got {window}, {min_count}")
        self.window, self.min_count = window, min_count
        self.mean_abs = self.mean = 0.0
        self.count = 0

    def update(self, predicted: float, measured: float) -> None:
        if measured <= 0 or not math.isfinite(predicted):
            return
        self.count += 1
        rel, rate = (predicted - measured) / measured, 1.0 / min(self.count, self.window)
        self.mean += (rel - self.mean) * rate
        self.mean_abs += (abs(rel) - self.mean_abs) * rate

    @property
    def value(self) -> float | None:
        return self.mean_abs if self.count >= self.min_count else None

    @property
    def bias(self) -> float | None:
        return self.mean if self.count >= self.min_count else None
