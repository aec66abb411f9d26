"""Eager scorers: one model forward over the flat scoring inputs, rows cut per scorer (inputs built
by the vectorised :mod:`specsched.scorers.metadata_gpu`, as for the graph scorers). With a
:class:`~specsched.models.piecewise_graphs.PiecewiseRunner` (``model.piecewise_graphs``) everything but
the attention replays per-token-count CUDA graphs; the attention stays eager, any rows, any k."""

from __future__ import annotations

import torch

from specsched.engine.request import Request
from specsched.kernels.metadata import AttentionMetadata
from specsched.models.graph_buckets import HostInputs
from specsched.models.llama import KVCache, LlamaForCausalLM
from specsched.models.piecewise_graphs import PiecewiseRunner
from specsched.proposers.base import Proposals
from specsched.scorers.base import Scorer
from specsched.scorers.metadata_gpu import build_scoring_inputs_vec, pack_scoring_batch


class EagerScorer(Scorer):
    is_expanded: bool = False  # True: k_i+1 single-query rows per request; False: one varlen row

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        block_size: int,
        piecewise: PiecewiseRunner | None = None,
    ) -> None:
        """``piecewise``: run every op but the attention on that runner's per-token-count CUDA graphs
        (models/piecewise_graphs.py); the attention stays eager, over the batch's own rows."""
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.device = model.lm_head.weight.device
        self.piecewise = piecewise

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.piecewise is not None:
            return self.piecewise.forward(ids, pos, meta)
        return self.model(ids, pos, meta, self.kv_cache)

    @torch.inference_mode()
    def score(self, batch: list[Request], proposals: Proposals) -> torch.Tensor:  # [sum(k_i+1), vocab]
        sb = pack_scoring_batch(batch, proposals, self.block_size)
        x = build_scoring_inputs_vec(sb, proposals.draft_tokens, self.device, is_expanded=self.is_expanded)
        logits = self._forward(x.input_ids, x.positions, x.meta)  # [padded tokens, vocab]
        return logits[: proposals.num_tokens + len(batch)]

    @torch.inference_mode()
    def decode_forward(
        self, x: HostInputs, device_ids: torch.Tensor | None = None
    ) -> torch.Tensor:  # [>= x.num_rows, vocab]
        ids, pos, meta, _ = x.to_device(self.device, device_ids, pad_tokens=self.device.type == "cuda")
        return self._forward(ids, pos, meta)
