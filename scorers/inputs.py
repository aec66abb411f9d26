"""Flat scoring inputs shared by the scorers: each request's last token then its drafts.

Request i contributes tokens ``[last_i, d_i1 .. d_ik]`` at positions ``n_i-1 .. n_i-1+k_i`` where
``n_i = req.num_tokens``. Both scorers run the same tokens; they differ only in how rows are cut:
MQA makes one row of ``k_i+1`` queries per request, batch expansion makes ``k_i+1`` rows of one query
that share the request's block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsched.daemon.request import Request
from specsched.kernels.metadata import AttentionMetadata, build_metadata
from specsched.proposers.base import Proposals


@dataclass
class ScoringInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_scoring_inputs(
    batch: list[Request], proposals: Proposals, block_size: int, device: torch.device, *, is_expanded: bool
) -> ScoringInputs:
    if proposals.num_requests != len(batch):
        raise ValueError(f"proposals cover {proposals.num_requests} requests, batch has {len(batch)}")
    drafts = proposals.draft_tokens.tolist()
    cu = proposals.cu_num_draft.tolist()
    ids: list[int] = []
    pos: list[int] = []
    q_lens: list[int] = []
    k_lens: list[int] = []
    tables: list[list[int]] = []
    for i, req in enumerate(batch):
        k = proposals.num_draft[i]
        n = req.num_tokens
        if req.num_computed != n - 1:
            raise RuntimeError(
                f"request {req.request_id} is not decoding: {req.num_computed} of {n} computed"
            )
        ids.append(req.last_token)
        ids.extend(drafts[cu[i] : cu[i + 1]])
        pos.extend(range(n - 1, n + k))
        if is_expanded:
            q_lens.extend([1] * (k + 1))
            k_lens.extend(range(n, n + k + 1))
            tables.extend([req.block_table] * (k + 1))
        else:
            q_lens.append(k + 1)
            k_lens.append(n + k)
            tables.append(req.block_table)
    meta = build_metadata(q_lens, k_lens, tables, block_size, device)
    return ScoringInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64).to(device),
        positions=torch.tensor(pos, dtype=torch.int64).to(device),
        meta=meta,
    )
