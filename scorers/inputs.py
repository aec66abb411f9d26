"""Flat model inputs: scoring (each request's last token then its drafts) and chunks of consecutive
tokens (prefill, a draft model's catch-up).

Scoring: request i contributes tokens ``[last_i, d_i1 .. d_ik]`` at positions ``n_i-1 .. n_i-1+k_i``
where ``n_i = req.num_tokens``. Both scorers run the same tokens; they differ only in how rows are
cut: MQA makes one row of ``k_i+1`` queries per request, batch expansion makes ``k_i+1`` rows of one
query that share the request's block table. :func:`build_scoring_inputs` is the per-token host-loop
reference; the scorers use the vectorised :mod:`specsched.scorers.metadata_gpu`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from specsched.engine.request import Request
from specsched.kernels.metadata import AttentionMetadata, build_metadata, host_metadata
from specsched.models.graph_buckets import HostInputs
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


def tokens_from(req: Request, start: int) -> list[int]:
    """``req.token_ids[start:]`` without building the whole prompt + output list."""
    num_prompt = req.num_prompt_tokens
    if start >= num_prompt:
        return req.output_ids[start - num_prompt :]
    return req.prompt_ids[start:] + req.output_ids


def chunk_host_inputs(
    tokens: list[list[int]],
    starts: list[int],
    block_tables: list[list[int]],
    block_size: int,
    logits_rows: list[int] | None = None,
) -> HostInputs:
    """Row i feeds ``tokens[i]`` at positions ``starts[i] ..`` (its cached prefix is ``starts[i]``
    keys), on the host; ``logits_indices`` [L] int64 is the flat index of the last token of each row
    in ``logits_rows`` (default every row): the logits to compute."""
    q = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    s = np.asarray(starts, dtype=np.int64).reshape(-1)
    cu, k, tables, slots = host_metadata(q, s + q, block_tables, block_size)
    t = int(cu[-1])
    ids = np.fromiter(chain.from_iterable(tokens), dtype=np.int64, count=t)
    positions = np.arange(t) + np.repeat(s - cu[:-1], q)
    last = cu[1:] - 1 if logits_rows is None else (cu[1:] - 1)[np.asarray(logits_rows, dtype=np.int64)]
    max_q, max_k = int(q.max(initial=0)), int(k.max(initial=0))
    return HostInputs(ids, positions, slots, cu, k, tables, max_q, max_k, logits_indices=last)


def decode_host_inputs(
    positions: np.ndarray,  # [r] int64: the position of row i's one token
    block_tables: np.ndarray,  # [r, w] int32, rows padded with 0
    num_blocks: np.ndarray,  # [r] int: real blocks of each row's table
    block_size: int,
) -> HostInputs:
    """Rows of one token each (a draft model's single-token steps) on the host; the ids are
    placeholders (the caller scatters the real ones on the device)."""
    r = len(positions)
    block = positions // block_size
    if (block >= num_blocks).any():
        i = int(np.argmax(block >= num_blocks))
        raise ValueError(f"row at position {positions[i]} needs {block[i] + 1} blocks, has {num_blocks[i]}")
    slots = block_tables[np.arange(r), block].astype(np.int64) * block_size + positions % block_size
    max_k = int(positions.max(initial=-1)) + 1
    return HostInputs(np.zeros(r, np.int64), positions, slots, np.arange(r + 1), positions + 1, block_tables,
                      min(r, 1), max_k)  # fmt: skip
