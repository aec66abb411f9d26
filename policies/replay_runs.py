"""Runs of plain decode steps in the replay: how many forwards the engine would run back to back for a
replayed batch, by the recorded run's scheduler options (engine/engine.py, engine/multi_step.py).

The engine runs a step whose plan drafts nothing as a *run* of several plain forwards with one host
read (vLLM's multi-step scheduling) in two cases:

- ``scheduler.decode_steps`` > 1: any batch (with ``decode_steps_max_batch`` set: of at most that many
  requests with none waiting for admission), when every k = 0 is the policy's choice and not a lack of
  drafts (an n-gram proposer without a match may have one after the next token: a run would skip it);
  a request alone runs at most about ``plain_decode_ms``, as below;
- ``scheduler.plain_decode_steps`` > 1 (the default 8 since 2026-12-07): a request decoding alone,
  none waiting, that cannot draft at all (proposer ``none`` or ``spec.max_k`` 0): runs of that many,
  capped to about ``plain_decode_ms`` by the measured ms of a plain forward.

:func:`run_length` mirrors those rules for a replayed step; the replay charges a run the cost models'
:meth:`~specsched.policies.cost_model.CostModels.predict_run` ms (their single-step models at the k = 0
shape, corrected by the runs the log measured) and advances each request by up to that many tokens.
Two things the replay cannot know are assumed: every request is greedy (runs need it; the logs of
``bench=serve`` and ``bench=regret`` are), and a request alone is capped by its recorded output length
(the engine caps it by ``max_tokens``: a request that stopped early on an end token ran a few forwards
more live).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specsched.policies.run_cost import capped_run_steps

__all__ = ["RunRules", "run_length"]


@dataclass(frozen=True)
class RunRules:
    """The scheduler options of runs of plain steps (``scheduler.*``; 1 / null: off)."""

    decode_steps: int = 1
    decode_steps_max_batch: int | None = None
    plain_decode_steps: int = 1
    plain_decode_ms: float | None = None

    def __post_init__(self) -> None:
        if self.decode_steps < 1 or self.plain_decode_steps < 1:
            raise ValueError(
                f"run rules need decode_steps and plain_decode_steps >= 1, got {self.decode_steps} and "
                f"{self.plain_decode_steps}"
            )

    @property
    def is_off(self) -> bool:
        return self.decode_steps <= 1 and self.plain_decode_steps <= 1

    @classmethod
    def from_scheduler(cls, scheduler: Mapping | None) -> RunRules:
        """From a log's ``scheduler`` config node; an option it lacks is off (the log predates it)."""
        node = scheduler if isinstance(scheduler, Mapping) else {}
        max_batch, ms = node.get("decode_steps_max_batch"), node.get("plain_decode_ms")
        return cls(
            decode_steps=int(node.get("decode_steps") or 1),
            decode_steps_max_batch=None if max_batch is None else int(max_batch),
            plain_decode_steps=int(node.get("plain_decode_steps") or 1),
            plain_decode_ms=None if ms is None else float(ms),
        )

    def plain_steps(self, forward_ms: float | None, steps: int | None = None) -> int:
        """``steps`` (default ``plain_decode_steps``) capped by ``plain_decode_ms`` over a plain
        forward's ms (one step while that is unknown), at least 1: the engine's ``_plain_steps``."""
        steps = self.plain_decode_steps if steps is None else steps
        return capped_run_steps(steps, self.plain_decode_ms, forward_ms)


def run_length(
    rules: RunRules,
    offers: Sequence[int],
    remaining: Sequence[int],
    proposer: str,
    max_k: int,
    is_waiting: bool,
    forward_ms: float | None = None,
) -> int:
    """Forwards a plan with every k = 0 would run for a batch of ``len(offers)`` requests (1: one
    plain step). ``offers[i]``: drafts request i's proposer had on offer (0 for an n-gram without a
    match); ``remaining[i]``: its tokens left to emit; ``is_waiting``: a request waits for admission;
    ``forward_ms``: a plain forward alone, for ``plain_decode_ms`` (module docstring)."""
    if len(offers) != len(remaining):
        raise ValueError(f"run_length needs one offer per request, got {len(offers)} and {len(remaining)}")
    b = len(offers)
    if b == 0:
        return 1
    cannot_draft = proposer == "none" or max_k == 0
    if b == 1 and cannot_draft and rules.plain_decode_steps > 1 and not is_waiting:  # plain alone
        steps = max(rules.decode_steps, rules.plain_steps(forward_ms))
    elif rules.decode_steps_max_batch is None or (b <= rules.decode_steps_max_batch and not is_waiting):
        steps = rules.decode_steps
        if b == 1 and steps > 1:  # a run alone lasts about plain_decode_ms too
            steps = rules.plain_steps(forward_ms, steps)
    else:
        return 1
    if steps <= 1 or (not cannot_draft and min(offers) == 0):  # a k = 0 for lack of drafts: no run
        return 1
    if b == 1:  # alone: no other row runs on for it (capped by its tokens left)
        steps = min(steps, remaining[0])
    return max(1, steps)
