"""Per-graph residual of a graph scorer's score model.

A graph scorer's step runs one captured graph, chosen by the step's padded shape (rows, tokens): its
time is a property of that graph (plus the attention's reads of the context), and need not be linear
in the padded sizes. On the H200 (2026-12-04, SmolLM2, MQA graph, batch 1) scoring 1 to 9 tokens took
1.29-1.36 ms, flat, while the linear model (:mod:`specsched.policies.shapes`' features) predicted
9 tokens (the 16-token graph) at 1.38 ms and 4 at 1.32: goodput then cut 8 offered drafts to 3 or 7
to stay in a smaller graph, a quarter of its steps, where fixed k = 8 was faster.

:class:`BucketBias` keeps, per graph (the key ``(rows padded, tokens padded)``), the running means of
the steps' score features x and measured ms y, and adds to that graph's predictions the current
linear model's residual at that mean point, ``mean y − w · mean x`` (the mean residual of those steps
under the coefficients w the model has *now*, so a model that moves does not leave a stale correction
behind), shrunk toward 0 while a graph has few steps (``· n / (n + shrink)``). Eager shapes (over the
largest graph) get none: their cost is the linear model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import mul

__all__ = ["BucketBias", "bucket_key"]


def bucket_key(x: Sequence[float]) -> tuple[int, int] | None:
    """The graph of a step with score features ``x`` ([1, rows padded, tokens padded, ctx, row ctx,
    is eager]): ``(rows, tokens)``, or None for an eager step."""
    return None if x[5] else (int(x[1]), int(x[2]))


class BucketBias:
    """Running means per graph: the first ``1 / rate`` steps of a graph averaged, later ones weighted
    ``rate`` (an exponential mean that forgets as the models do). ``rate`` 0.1: a graph that the
    start-up profile timed over 18 steps 0.33 ms too slow (H100, 2026-12-06, the 7B pair at batch 4)
    is within 0.07 ms after ~15 later steps (goodput's tries, policies/goodput.py); at 0.02, ~70."""

    def __init__(self, rate: float = 0.1, shrink: float = 8.0) -> None:
        if not 0.0 < rate <= 1.0 or shrink < 0.0:
            raise ValueError(f"need 0 < rate <= 1 and shrink >= 0, got rate={rate}, shrink={shrink}")
        self.rate, self.shrink = rate, shrink
        self.stats: dict[tuple[int, int], list] = {}  # graph -> [steps, mean y, [mean x]]

    def __bool__(self) -> bool:
        return bool(self.stats)

    def update(self, key: tuple[int, int] | None, x: Sequence[float], y: float) -> None:
        """A step of graph ``key`` with score features ``x`` took ``y`` ms."""
        if key is None:
            return
        found = self.stats.get(key)
        if found is None:
            self.stats[key] = [1.0, float(y), [float(v) for v in x]]
            return
        found[0] += 1.0
        a = max(1.0 / found[0], self.rate)
        found[1] += (y - found[1]) * a
        found[2] = [m + (v - m) * a for m, v in zip(found[2], x)]

    def value(self, key: tuple[int, int] | None, coef: Sequence[float]) -> float:
        """The ms to add to the linear prediction (coefficients ``coef``) of a step in graph ``key``:
        0 for eager steps and graphs not seen yet."""
        found = self.stats.get(key) if key is not None else None
        if found is None:
            return 0.0
        n, mean_y, mean_x = found
        return (mean_y - sum(map(mul, coef, mean_x))) * n / (n + self.shrink)

    def state(self) -> list[list[float]]:
        """``[rows, tokens, steps, mean ms, *mean features]`` per graph (the cost_models table)."""
        return [[r, t, n, y, *x] for (r, t), (n, y, x) in sorted(self.stats.items())]

    def load_state(self, entries: list[list[float]]) -> None:
        self.stats = {
            (int(e[0]), int(e[1])): [float(e[2]), float(e[3]), [float(v) for v in e[4:]]] for e in entries
        }
