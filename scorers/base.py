"""Scorer interface: one target forward over each request's last token plus its drafts."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from specsched.engine.request import Request
from specsched.models.graph_buckets import HostInputs
from specsched.proposers.base import Proposals


class Scorer(ABC):
    """Returns target logits at the k_i+1 positions of every request, flattened in request order:
    rows ``cu_num_draft[i] + i .. cu_num_draft[i+1] + i`` belong to request i (its last token's
    logits first, then one row per draft). The result may be a view of a buffer the scorer owns
    (the graph scorers' static logits), valid until the scorer's next call."""

    name: str = "base"

    @abstractmethod
    def score(self, batch: list[Request], proposals: Proposals) -> torch.Tensor:  # [sum(k_i+1), vocab]
        ...

    def decode_forward(
        self, x: HostInputs, device_ids: torch.Tensor | None = None
    ) -> torch.Tensor:  # [>= x.num_rows, vocab]
        """The target's logits for ``x``'s rows of one token each (a plain decode step from host
        inputs, :mod:`specsched.scorers.multi_step`); ``device_ids``: the ids at ``x.scatter_index``."""
        raise NotImplementedError(f"scorer {self.name!r} cannot run plain decode steps from host inputs")
