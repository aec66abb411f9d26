"""Step counters: throughput, acceptance per proposer, step time per scorer, process memory.

One home for the statistics. :class:`EngineStats` accumulates the engine's step records; the engine
keeps one (its free-form counters, the ``engine`` map of a ``stats_reply``, via ``to_dict``) and the
daemon's serving loop keeps another with its ``stats_window_s`` (the reply's ``tokens_per_s``,
``proposers`` and ``scorers``: daemon/stats_reply.py turns it into protocol messages).
:func:`rss_bytes` is the process's resident memory.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

from specsched.engine.records import StepRecord


@dataclass
class EngineStats:
    """Step counters. Acceptance and scorer times count decode steps only (prefill steps neither
    propose nor score); tokens count every step."""

    window_s: float = 10.0  # the tokens/s window
    num_steps: int = 0
    num_prefill_steps: int = 0
    num_tokens_out: int = 0
    proposed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    accepted: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    scorer_steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    scorer_ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # the scorer's forward
    scorer_step_ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # whole steps
    started: float = field(default_factory=time.monotonic)
    _recent: deque = field(default_factory=deque)  # (time.monotonic(), tokens) of the steps in the window
    _recent_tokens: int = 0  # the sum of _recent's tokens (kept as steps enter and leave the window)

    def observe(self, rec: StepRecord) -> None:
        self.num_steps += 1
        self.num_tokens_out += rec.num_emitted
        now = time.monotonic()
        self._recent.append((now, rec.num_emitted))
        self._recent_tokens += rec.num_emitted
        self._forget_before(now - self.window_s)
        if rec.kind == "prefill":
            self.num_prefill_steps += 1
            return
        if rec.proposer:
            self.proposed[rec.proposer] += rec.num_proposed
            self.accepted[rec.proposer] += rec.num_accepted
        if rec.scorer:
            self.scorer_steps[rec.scorer] += 1
            self.scorer_ms[rec.scorer] += rec.score_ms
            self.scorer_step_ms[rec.scorer] += rec.total_ms

    @property
    def tokens_per_s(self) -> float:
        """Tokens over the span from the first to the last step of the window (0 before two steps)."""
        if len(self._recent) < 2:
            return 0.0
        span = max(self._recent[-1][0] - self._recent[0][0], 1e-3)
        return self._recent_tokens / span

    def recent_tokens_per_s(self) -> float:
        """Tokens emitted in the last ``window_s`` seconds up to now / the window (shorter right after
        start); falls to 0 when the engine idles. What ``stats_reply.tokens_per_s`` reports."""
        now = time.monotonic()
        self._forget_before(now - self.window_s)
        span = min(self.window_s, max(now - self.started, 1e-3))
        return self._recent_tokens / span

    def to_dict(self) -> dict:
        return {
            "steps": self.num_steps,
            "prefill_steps": self.num_prefill_steps,
            "tokens_out": self.num_tokens_out,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "acceptance": {
                p: {"proposed": n, "accepted": self.accepted[p], "rate": self.accepted[p] / n if n else None}
                for p, n in self.proposed.items()
            },
            "scorers": {
                s: {"steps": n, "mean_score_ms": self.scorer_ms[s] / n} for s, n in self.scorer_steps.items()
            },
        }

    def _forget_before(self, t: float) -> None:
        recent = self._recent
        while recent and recent[0][0] < t:
            self._recent_tokens -= recent.popleft()[1]


def rss_bytes() -> int:
    """This process's resident memory (``VmRSS`` of /proc/self/status); 0 where there is none."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
