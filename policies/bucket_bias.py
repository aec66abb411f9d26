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

*Winsorized*: a step's ms moves its graph's mean by at most ``CLIP`` spreads (the graph's running mean
absolute deviation, at least ``FLOOR`` of its mean) away from it. On the H100 on 2026-12-06 (goodput's
serve log, batch 1) the 9-token MQA graph's median score was 1.055 ms, but 13 of its 870 steps took
1.5-5.8 ms (the host slow to launch them, policies/launch_guard.py), most of them late in the run when
goodput visited that graph rarely; at the residual's rate of 0.1 they held its mean at up to 1.96 ms
(1.78 at the end), so goodput drafted 3 or 7 of 8 offered drafts (the 4- and 8-token graphs) on 41 %
of its drafting steps, where k = 8 costs the same step (1.285 against 1.279 ms) and makes 2.33 tokens
against 1.75 for k = 3; and a graph priced too dear is seldom visited again to be corrected. A lasting
change of a graph's cost still comes through: each step's deviation widens the spread (as far as the
bound: the spread grows by up to ``(CLIP − 1) · rate`` of itself a step), so the bound grows to let a
shift of any size in (a graph moved from 1.05 to 1.6 ms is within 2 % of it after 30 steps, where 8
steps of 1.4-5.8 ms move it 0.08 ms, the plain mean 0.45; tests/policies/test_bucket_bias.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import mul

__all__ = ["BucketBias", "bucket_key"]

CLIP = 3.0  # a step moves its graph's mean by at most this many spreads (mean absolute deviations)
FLOOR = 0.02  # ... and a spread is at least this share of the graph's mean ms (launch-bound jitter)
SPREAD_CAP = 1.0  # a deviation counts toward the spread up to this many bounds
MIN_CLIPPED = 4  # the first steps of a graph are averaged as they come (no spread to clip by yet)
NUM_FEATURES = 6  # score features x: [1, rows padded, tokens padded, ctx, row ctx, is eager]


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
        self.stats: dict[tuple[int, int], list] = {}  # graph -> [steps, mean y, [mean x], spread]

    def __bool__(self) -> bool:
        return bool(self.stats)

    def update(self, key: tuple[int, int] | None, x: Sequence[float], y: float) -> None:
        """A step of graph ``key`` with score features ``x`` took ``y`` ms (winsorized: module
        docstring)."""
        if key is None:
            return
        found = self.stats.get(key)
        if found is None:
            self.stats[key] = [1.0, float(y), [float(v) for v in x], 0.0]
            return
        found[0] += 1.0
        n, mean_y = found[0], found[1]
        a = max(1.0 / n, self.rate)
        dev = y - mean_y
        if n > MIN_CLIPPED:
            bound = CLIP * max(found[3], FLOOR * abs(mean_y))
            found[3] += (min(abs(dev), SPREAD_CAP * bound) - found[3]) * a
            dev = min(max(dev, -bound), bound)
        else:
            found[3] += (abs(dev) - found[3]) * a
        found[1] = mean_y + dev * a
        found[2] = [m + (v - m) * a for m, v in zip(found[2], x)]

    def value(self, key: tuple[int, int] | None, coef: Sequence[float]) -> float:
        """The ms to add to the linear prediction (coefficients ``coef``) of a step in graph ``key``:
        0 for eager steps and graphs not seen yet."""
        found = self.stats.get(key) if key is not None else None
        if found is None:
            return 0.0
        n, mean_y, mean_x, _ = found
        return (mean_y - sum(map(mul, coef, mean_x))) * n / (n + self.shrink)

    def state(self) -> list[list[float]]:
        """``[rows, tokens, steps, mean ms, *mean features, spread]`` per graph (the cost_models table)."""
        return [[r, t, n, y, *x, d] for (r, t), (n, y, x, d) in sorted(self.stats.items())]

    def load_state(self, entries: list[list[float]]) -> None:
        """Graphs as :meth:`state` gives them; an entry without a spread (saved before 2026-12-06)
        gets none (its bound is then ``FLOOR`` of its mean)."""
        end = 4 + NUM_FEATURES
        self.stats = {
            (int(e[0]), int(e[1])): [
                float(e[2]),
                float(e[3]),
                [float(v) for v in e[4:end]],
                float(e[end]) if len(e) > end else 0.0,
            ]
            for e in entries
        }
