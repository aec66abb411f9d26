"""Requests and their sampling parameters: the engine's unit of work."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How one request samples. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0) or not math.isfinite(self.top_p):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SpecParams:
    """Per-request speculation limits (the wire's ``spec`` field)."""

    max_k: int | None = None  # cap on k for this request; None = the engine's
    proposer: str | None = None  # proposer name; None = the engine's default

    def __post_init__(self) -> None:
        if self.max_k is not None and self.max_k < 0:
            raise ValueError(f"spec.max_k must be >= 0, got {self.max_k}")


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled, client gone, or shutdown
    TIMEOUT = "timeout"  # per-request deadline passed
    ERROR = "error"


@dataclass
class Request:
    """One generation request as the engine tracks it.

    Token layout: ``token_ids = prompt + output``. The target's KV cache holds the first
    ``num_computed`` tokens; in decode ``num_computed == len(token_ids) - 1`` (the last token is the
    next step's input). A draft model proposer tracks its own ``num_draft_computed``.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    spec: SpecParams = field(default_factory=SpecParams)
    arrival_time: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_draft_computed: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    num_spec_steps: int = 0
    num_preemptions: int = 0
    last_k: int = 0  # drafts scored last decode step
    last_accepted: int = 0  # drafts accepted last decode step
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    client: bytes | None = None  # opaque: the daemon's routing identity

    def __post_init__(self) -> None:
        if self.sampling.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def proposer(self) -> str | None:
        return self.spec.proposer

    @property
    def is_prefill(self) -> bool:
        return self.num_computed < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]
