"""What a change of the decode batch costs a step, read off a recorded run for the replay.

The cost models price a step from its shape (batch size, tokens, context). A serving log shows a second
factor they do not see: **churn**, the requests that joined or left the decode batch since the last
decode step. On the H200 (2026-12-05 04:35, k = 8 on the MQA graph, 64 clients) a step right after a
request finished ran 5.56 ms against 4.91 for a step with the batch unchanged (its ``between`` 0.95 vs
0.72 ms: the finished request's done, log row and last chunk), and a step a request joined (its
prefill step in between) 4.15 ms. The linear models average these, so a replay priced steps of full
batches too dear and steps after a finish too cheap; replaying a log under its own policy missed the
live tokens/s by +9 / −6 % at N = 4 / 16.

:class:`ChurnResidual` keeps, per (batch-size group, churn class), the mean of ``measured − predicted``
step ms over the run's decode steps (the refitted models' prediction), and the replay adds it to each
simulated step of that group and class. Classes (:func:`churn_class`): ``left`` (a request of the last
decode step is gone; it takes precedence: a replay without client round trips admits a finished
client's next request at the very next step, where live a step without it, then its prefill, came
first), ``join`` (only new requests), ``same``. A cell with fewer than :data:`MIN_STEPS` steps adds
nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from specsched.engine.records import StepRecord

__all__ = ["CHURN_CLASSES", "GROUPS", "MIN_STEPS", "ChurnResidual", "churn_class", "group_of"]

CHURN_CLASSES = ("left", "join", "same")
GROUPS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 1 << 30))  # batch sizes, inclusive
MIN_STEPS = 20  # a (group, class) cell with fewer recorded steps adds nothing


def group_of(batch_size: int) -> int:
    """The index in :data:`GROUPS` of the group ``batch_size`` falls in."""
    return next(i for i, (lo, hi) in enumerate(GROUPS) if lo <= batch_size <= hi)


def churn_class(last: set[str] | None, now: set[str]) -> str:
    """``left`` when a request of the last decode step (ids ``last``) is not in this one (``now``),
    else ``join`` when this one has a request the last did not, else ``same`` (also for the first
    step: ``last`` None)."""
    if last is None:
        return "same"
    if not last <= now:
        return "left"
    return "join" if not now <= last else "same"


@dataclass
class ChurnResidual:
    """Mean residual step ms per (batch-size group, churn class); see the module docstring."""

    sums: dict[tuple[int, str], float] = field(default_factory=dict)
    counts: dict[tuple[int, str], int] = field(default_factory=dict)

    @classmethod
    def fit(
        cls,
        steps: Iterable[StepRecord],
        predicted_ms: Callable[[StepRecord], float],
        measured_ms: Callable[[StepRecord], float],
    ) -> ChurnResidual:
        """From decode ``steps`` in log order (prefill steps between them do not count as steps: a
        request's prefill step is how it joins), each step's ``measured_ms - predicted_ms``."""
        out, last = cls(), None
        for rec in steps:
            if rec.kind != "decode" or not rec.requests:
                continue
            now = {r.request_id for r in rec.requests}
            key = (group_of(rec.batch_size), churn_class(last, now))
            last = now
            out.sums[key] = out.sums.get(key, 0.0) + measured_ms(rec) - predicted_ms(rec)
            out.counts[key] = out.counts.get(key, 0) + 1
        return out

    def ms(self, batch_size: int, cls: str) -> float:
        """The residual to add to a step of ``batch_size`` requests and churn class ``cls``."""
        key = (group_of(batch_size), cls)
        n = self.counts.get(key, 0)
        return self.sums[key] / n if n >= MIN_STEPS else 0.0

    def charged(self, predicted_ms: float, last: set[str] | None, now: set[str]) -> float:
        """A step's predicted ms with its residual (batch ``now``, the last step's ``last``): at least
        half the prediction (a residual fitted on steps unlike this one must not zero it)."""
        return max(predicted_ms + self.ms(len(now), churn_class(last, now)), 0.5 * predicted_ms)

    def table(self) -> Mapping[tuple[str, str], tuple[int, float]]:
        """(group label, class) -> (steps, mean residual ms), for reports."""
        out = {}
        for (g, c), n in sorted(self.counts.items()):
            lo, hi = GROUPS[g]
            label = str(lo) if lo == hi else f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi}"
            out[(label, c)] = (n, self.sums[(g, c)] / n)
        return out
