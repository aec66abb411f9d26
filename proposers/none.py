"""The no-op proposer: speculation off (every request gets k = 0)."""

from __future__ import annotations

from specsched.engine.request import Request
from specsched.proposers.base import Proposals, Proposer, ProposerPeek


class NoProposer(Proposer):
    name = "none"

    def __init__(self, device="cpu") -> None:
        self.device = device

    def peek(self, batch: list[Request]) -> ProposerPeek:
        return ProposerPeek(max_k=[0] * len(batch))

    def propose(self, batch: list[Request], k: list[int]) -> Proposals:
        return Proposals.from_lists([[] for _ in batch])  # on the host: no device copy
