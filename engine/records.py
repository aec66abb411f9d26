"""What the engine records each step: the input of cost models, the SQLite log and the replay."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import attrgetter


@dataclass
class StepRequestRecord:
    request_id: str
    context_len: int  # tokens before this step's input token (KV cached), i.e. position of the input token
    k: int  # drafts scored (<= planned k when the proposer had fewer)
    num_accepted: int  # drafts accepted (0..k); emitted = num_accepted + 1
    match_bits: str = ""  # greedy only: "1" per draft that matched the target, up to the first "0"
    num_emitted: int = 0  # tokens committed to the output (num_accepted + 1, fewer when a stop cut the step)
    max_k: int | None = None  # the most drafts the policy could give it this step (proposer, lengths, caps)


@dataclass
class StepRecord:
    step: int
    kind: str  # "prefill" | "decode"
    start_time: float  # time.time() at step start
    batch_size: int
    num_tokens: int  # tokens run through the target this step
    scorer: str | None = None  # decode steps only
    policy: str | None = None
    proposer: str | None = None
    is_synthetic: bool = False
    predicted_propose_ms: float | None = None
    predicted_score_ms: float | None = None
    predicted_verify_ms: float | None = None
    predicted_ms: float | None = None  # predicted total
    propose_ms: float = 0.0
    score_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0  # schedule .. commit, measured
    num_emitted: int = 0
    plan_info: dict = field(default_factory=dict)  # the policy's reasoning (JSON in the log)
    # plain decode steps this record ran back to back (scheduler.decode_steps; in the log as
    # plan_info's "decode_steps" when > 1): its times cover that many forwards
    num_decode_steps: int = 1
    # this step drafts (or runs plain steps) and the engine's decode step before it drafted nothing
    # (a run of plain steps, or one plain step): a proposer with its own KV cache (a draft model)
    # caught up over those steps' tokens in this step's propose, a one-off cost of leaving them (in
    # the log as plan_info's "is_after_run"; the cost models' propose fit skips it and keeps it as
    # the proposer's catch-up cost)
    is_after_run: bool = False
    # host (perf_counter) ms per phase: schedule, view, decide, reserve, propose, score, overlap,
    # verify (with its wait for the GPU), commit, record, stats, other (engine.step_timer)
    host_ms: dict[str, float] = field(default_factory=dict)
    requests: list[StepRequestRecord] = field(default_factory=list)

    @property
    def cost_ms(self) -> float:
        """What the step cost the serving loop: ``total_ms`` plus the caller's time before it
        (``host_ms["between"]``, e.g. the daemon streaming the last step's outputs; 0 when absent).
        The cost models predict this (policies/cost_model.py)."""
        between = self.host_ms.get("between", 0.0) if self.host_ms and self.total_ms > 0 else 0.0
        return self.total_ms + between if math.isfinite(between) and between > 0 else self.total_ms

    @property
    def num_proposed(self) -> int:
        return sum(map(_k, self.requests))

    @property
    def num_accepted(self) -> int:
        return sum(map(_num_accepted, self.requests))


@dataclass
class RequestOutput:
    """What one step produced for one request (streamed to its client)."""

    request_id: str
    new_token_ids: list[int]
    num_proposed: int = 0  # drafts proposed for it this step
    num_accepted: int = 0
    finish_reason: str | None = None  # set when the request finished this step

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


_k, _num_accepted = attrgetter("k"), attrgetter("num_accepted")
