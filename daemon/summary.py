"""What a run's steps decided, in aggregate: ``specsched-generate`` prints it after the completion."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from specsched.engine.records import StepRecord


@dataclass
class StepSummary:
    """What a run's steps decided, in aggregate (``specsched-generate`` prints it)."""

    num_steps: int
    num_decode_steps: int
    num_emitted: int
    num_proposed: int
    num_accepted: int
    num_request_steps: int  # (request, decode step) pairs: the denominator of mean k
    scorer_steps: dict[str, int]
    policy_steps: dict[str, int]
    step_ms: float  # measured, summed
    wall_s: float

    @property
    def mean_k(self) -> float:
        return self.num_proposed / self.num_request_steps if self.num_request_steps else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.num_accepted / self.num_proposed if self.num_proposed else None

    @property
    def tokens_per_s(self) -> float:
        return self.num_emitted / self.wall_s if self.wall_s > 0 else 0.0

    def format(self) -> str:
        def mix(counts: dict[str, int]) -> str:
            return ", ".join(f"{name} {n}" for name, n in sorted(counts.items())) or "-"

        acc = "-" if self.acceptance is None else f"{self.acceptance:.1%}"
        rows = [
            ("steps", f"{self.num_steps} ({self.num_decode_steps} decode), {self.step_ms:.1f} ms measured"),
            ("policy", mix(self.policy_steps)),
            ("mean k", f"{self.mean_k:.2f}"),
            ("scorer mix", mix(self.scorer_steps)),
            ("acceptance", f"{acc} ({self.num_accepted}/{self.num_proposed} drafts)"),
            ("tokens", f"{self.num_emitted} in {self.wall_s:.2f} s = {self.tokens_per_s:.1f} tokens/s"),
        ]
        return "\n".join(f"{label:<11} {value}" for label, value in rows)


def summarize_steps(records: list[StepRecord], wall_s: float) -> StepSummary:
    decode = [r for r in records if r.kind == "decode"]
    return StepSummary(
        num_steps=len(records),
        num_decode_steps=len(decode),
        num_emitted=sum(r.num_emitted for r in records),
        num_proposed=sum(r.num_proposed for r in decode),
        num_accepted=sum(r.num_accepted for r in decode),
        num_request_steps=sum(len(r.requests) for r in decode),
        scorer_steps=dict(Counter(r.scorer for r in decode if r.scorer)),
        policy_steps=dict(Counter(r.policy for r in decode if r.policy)),
        step_ms=sum(r.total_ms for r in records),
        wall_s=wall_s,
    )
