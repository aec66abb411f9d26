"""Engine-side counters for ``stats``: throughput, acceptance per proposer, step time per scorer."""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

from specsched.daemon.records import StepRecord


@dataclass
class EngineStats:
    window_s: float = 10.0
    num_steps: int = 0
    num_prefill_steps: int = 0
    num_tokens_out: int = 0
    proposed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    accepted: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    scorer_steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    scorer_ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _recent: deque = field(default_factory=deque)  # (time, tokens)

    def observe(self, rec: StepRecord) -> None:
        self.num_steps += 1
        self.num_tokens_out += rec.num_emitted
        now = time.time()
        self._recent.append((now, rec.num_emitted))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        if rec.kind == "prefill":
            self.num_prefill_steps += 1
            return
        if rec.proposer:
            self.proposed[rec.proposer] += rec.num_proposed
            self.accepted[rec.proposer] += rec.num_accepted
        if rec.scorer:
            self.scorer_steps[rec.scorer] += 1
            self.scorer_ms[rec.scorer] += rec.score_ms

    @property
    def tokens_per_s(self) -> float:
        if len(self._recent) < 2:
            return 0.0
        span = max(self._recent[-1][0] - self._recent[0][0], 1e-3)
        return sum(n for _, n in self._recent) / span

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
