"""Proposer interface: cheap facts for the policy (peek), then ragged draft tokens (propose)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from specsched.engine.request import Request

if TYPE_CHECKING:
    from specsched.models.llama import KVCache, LlamaForCausalLM


@dataclass
class Proposals:
    """Ragged draft tokens for a batch. Request i's drafts are
    ``draft_tokens[cu_num_draft[i]:cu_num_draft[i+1]]``; ``num_draft[i]`` may be 0."""

    draft_tokens: torch.Tensor  # [N] int64; on the host (n-gram, none) or the device (greedy draft model)
    cu_num_draft: torch.Tensor  # [B+1] int64
    draft_probs: torch.Tensor | None  # [N, vocab] float32, None for deterministic proposers
    num_draft: list[int]  # [B] host ints (the k actually proposed; <= planned k)
    is_synthetic: bool = False  # True for the benchmark-only synthetic-acceptance proposer

    @property
    def num_requests(self) -> int:
        return len(self.num_draft)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_draft)

    @property
    def max_k(self) -> int:
        return max(self.num_draft, default=0)

    @staticmethod
    def from_lists(drafts: list[list[int]], device: torch.device | str = "cpu") -> Proposals:
        """Build deterministic proposals (one-hot q) from plain lists (on the host by default:
        scorers and verification read host drafts without a device copy)."""
        num = [len(d) for d in drafts]
        cu = np.zeros(len(num) + 1, dtype=np.int64)
        # numpy, not torch ops: a torch op releases the GIL, and in the daemon the IO thread (busy
        # sending the last step's chunks) then holds the engine thread before its GPU launch
        if not any(num):  # no drafts (a non-speculative step): the offsets are the zeros
            flat = np.zeros(0, dtype=np.int64)
        else:
            np.cumsum(num, out=cu[1:])
            flat = np.fromiter(chain.from_iterable(drafts), dtype=np.int64, count=int(cu[-1]))
        flat, cu_t = torch.from_numpy(flat), torch.from_numpy(cu)
        if device != "cpu" and torch.device(device).type != "cpu":
            flat, cu_t = flat.to(device), cu_t.to(device)
        return Proposals(draft_tokens=flat, cu_num_draft=cu_t, draft_probs=None, num_draft=num)


@dataclass
class ProposerPeek:
    """What a proposer can say about a request before the plan: ``max_k`` it could propose now
    (e.g. the n-gram match length; a large number for a draft model)."""

    max_k: list[int]  # [B]


class Proposer(ABC):
    """Draft-token source. Registered by name in ``specsched.proposers.registry``."""

    name: str = "base"
    is_synthetic: bool = False

    def peek(self, batch: list[Request]) -> ProposerPeek:
        """Cheap per-request facts for the policy. Default: no limit beyond the engine's."""
        return ProposerPeek(max_k=[1 << 30] * len(batch))

    def draft_model(self) -> tuple[LlamaForCausalLM, KVCache] | None:
        """The model this proposer runs and its KV cache, for the start-up kernel warm-up
        (engine/warmup.py); None: it runs none."""
        return None

    @abstractmethod
    def propose(self, batch: list[Request], k: list[int]) -> Proposals:
        """Propose up to ``k[i]`` tokens for request i (0 allowed)."""

    def on_prefill(self, batch: list[Request]) -> None:  # noqa: B027 (optional hook)
        """Called while the target runs a prefill forward over (chunks of) ``batch``'s prompts (on CUDA
        while the GPU runs: host work here is off the critical path up to the forward's time); the
        whole prompt of each request is known, its first output token is not."""

    def on_scoring(self, batch: list[Request]) -> None:  # noqa: B027 (optional hook)
        """Called while the target scores this step's drafts of ``batch`` (on CUDA while the GPU runs:
        host work here is off the step's critical path up to the forward's time); the requests' tokens
        are this step's, not committed yet."""

    def on_commit(self, batch: list[Request]) -> None:  # noqa: B027 (optional hook)
        """Called after the step's tokens are committed (roll back own state)."""

    def on_finish(self, request: Request) -> None:  # noqa: B027 (optional hook)
        """Called when a request leaves the engine."""
