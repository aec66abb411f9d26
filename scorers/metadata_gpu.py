"""Scoring inputs built with vectorised torch ops on the target device (no Python loop over tokens).

Same layout as :func:`specsched.scorers.inputs.build_scoring_inputs` (which loops over tokens on
the host): request i scores ``[last_i, d_i1 .. d_ik]`` at positions ``n_i-1 .. n_i-1+k_i``
(``n_i = req.num_tokens``); MQA cuts one row of ``k_i+1`` queries per request, batch expansion
``k_i+1`` single-query rows that share the request's block table.

The host side (:func:`pack_scoring_batch`) only gathers per-request facts into small tensors: token
count n, draft count k, last token and the block-table row, padded to the widest. The device side
(:func:`build_scoring_inputs_vec`) copies them over once and derives everything per token from
``req = repeat_interleave(k + 1)`` (the request of each token) and ``j`` (its index in the request):
``position = n[req] - 1 + j``, ``id = last[req] if j == 0 else drafts[cu_k[req] + j - 1]``,
``slot = block_table[req, position // bs] * bs + position % bs``. The output sizes are known on the
host, so nothing syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specsched.daemon.request import Request
from specsched.kernels.metadata import AttentionMetadata
from specsched.proposers.base import Proposals
from specsched.scorers.inputs import ScoringInputs


@dataclass
class ScoringBatch:
    """Per-request host facts of one scoring step (no per-token data)."""

    num_tokens: np.ndarray  # [B] int64: n_i; the KV cache holds n_i - 1 tokens, the last is scored first
    num_draft: np.ndarray  # [B] int64: k_i
    last_tokens: np.ndarray  # [B] int64
    block_tables: np.ndarray  # [B, W] int32, rows padded with 0 (block 0 is the reserved pad block)
    block_size: int

    @property
    def num_requests(self) -> int:
        return int(self.num_tokens.shape[0])

    @property
    def total_tokens(self) -> int:
        """Tokens scored: sum of k_i + 1."""
        return int(self.num_draft.sum()) + self.num_requests

    @property
    def width(self) -> int:
        return int(self.block_tables.shape[1])

    @property
    def max_k(self) -> int:
        """Keys of the longest row (a host upper bound for the metadata)."""
        return int((self.num_tokens + self.num_draft).max(initial=0))

    def num_rows(self, is_expanded: bool) -> int:
        return self.total_tokens if is_expanded else self.num_requests

    def max_q(self, is_expanded: bool) -> int:
        if not self.num_requests:
            return 0
        return 1 if is_expanded else int(self.num_draft.max()) + 1


def pack_scoring_batch(batch: list[Request], proposals: Proposals, block_size: int) -> ScoringBatch:
    """Gather the per-request facts; checks what :func:`build_scoring_inputs` checks, plus that each
    block table covers the scored positions (an index past it would fault on the device)."""
    if proposals.num_requests != len(batch):
        raise ValueError(f"proposals cover {proposals.num_requests} requests, batch has {len(batch)}")
    b = len(batch)
    n = np.fromiter((r.num_tokens for r in batch), dtype=np.int64, count=b)
    computed = np.fromiter((r.num_computed for r in batch), dtype=np.int64, count=b)
    bad = np.flatnonzero(computed != n - 1)
    if bad.size:
        i = bad[0]
        raise RuntimeError(f"request {batch[i].request_id} is not decoding: {computed[i]} of {n[i]} computed")
    k = np.asarray(proposals.num_draft, dtype=np.int64).reshape(b)
    lens = np.fromiter((len(r.block_table) for r in batch), dtype=np.int64, count=b)
    short = np.flatnonzero(lens * block_size < n + k)
    if short.size:
        i = short[0]
        raise ValueError(
            f"request {batch[i].request_id}: its block table of {lens[i]} blocks holds "
            f"{lens[i] * block_size} tokens, scoring {k[i]} drafts needs {n[i] + k[i]}"
        )
    tables = np.zeros((b, max(int(lens.max(initial=0)), 1)), dtype=np.int32)
    for i, r in enumerate(batch):
        tables[i, : lens[i]] = r.block_table
    last = np.fromiter((r.last_token for r in batch), dtype=np.int64, count=b)
    return ScoringBatch(n, k, last, tables, block_size)


def build_scoring_inputs_vec(
    sb: ScoringBatch,
    draft_tokens: torch.Tensor,  # [sum k_i] int64, request-major (Proposals.draft_tokens)
    device: torch.device | str,
    *,
    is_expanded: bool,
) -> ScoringInputs:
    """The scoring inputs of :func:`build_scoring_inputs`, computed on ``device`` from ``sb``."""
    b, t, bs = sb.num_requests, sb.total_tokens, sb.block_size
    num_drafts = int(sb.num_draft.sum())
    if draft_tokens.shape != (num_drafts,):
        raise ValueError(
            f"draft_tokens must be [{num_drafts}] (sum of num_draft), got {tuple(draft_tokens.shape)}"
        )
    q_lens = sb.num_draft + 1
    tok_start = np.cumsum(q_lens) - q_lens  # first token of each request
    draft_start = np.cumsum(sb.num_draft) - sb.num_draft  # first draft of each request
    host = np.stack([sb.num_tokens, sb.last_tokens, tok_start, draft_start, q_lens])  # [5, B]
    info = torch.from_numpy(host).to(device)
    tables = torch.from_numpy(sb.block_tables).to(device)  # [B, W] int32
    n, last, tok0, d0, q = info.unbind(0)

    req = torch.repeat_interleave(q, output_size=t)  # [T] request of each token
    j = torch.arange(t, device=info.device) - tok0[req]  # [T] index within the request
    positions = n[req] - 1 + j
    if num_drafts:
        drafts = draft_tokens.to(info.device, torch.int64)
        input_ids = torch.where(j == 0, last[req], drafts[(d0[req] + j - 1).clamp_(min=0)])
    else:
        input_ids = last[req]
    block = tables[req, torch.div(positions, bs, rounding_mode="floor")].to(torch.int64)
    slot_mapping = block * bs + positions % bs

    if is_expanded:
        cu = torch.arange(t + 1, dtype=torch.int32, device=info.device)
        seq_lens = (positions + 1).to(torch.int32)
        row_tables = tables.index_select(0, req)
    else:
        cu = torch.zeros(b + 1, dtype=torch.int32, device=info.device)
        cu[1:] = torch.cumsum(q, 0)
        seq_lens = (n + q - 1).to(torch.int32)
        row_tables = tables
    meta = AttentionMetadata(
        cu_seqlens_q=cu,
        seq_lens_k=seq_lens,
        block_tables=row_tables,
        slot_mapping=slot_mapping,
        max_q=sb.max_q(is_expanded),
        max_k=sb.max_k,
    )
    return ScoringInputs(input_ids=input_ids, positions=positions, meta=meta)
