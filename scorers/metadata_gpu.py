"""Scoring inputs built with vectorised numpy on the host and one copy to the device (no Python
loop over tokens, no sync).

Same layout as :func:`specsched.scorers.inputs.build_scoring_inputs` (the per-token host-loop
reference): request i scores ``[last_i, d_i1 .. d_ik]`` at positions ``n_i-1 .. n_i-1+k_i``
(``n_i = req.num_tokens``); MQA cuts one row of ``k_i+1`` queries per request, batch expansion
``k_i+1`` single-query rows that share the request's block table.

:func:`pack_scoring_batch` gathers the per-request facts into small arrays: token count n, draft
count k, last token and the block-table row, padded to the widest. :func:`scoring_host_inputs`
derives everything per token from ``req = repeat(arange(B), k + 1)`` (the request of each token) and
``j`` (its index in the request): ``position = n[req] - 1 + j``, ``id = last[req] if j == 0 else
drafts[cu_k[req] + j - 1]``, ``slot = block_table[req, position // bs] * bs + position % bs``. All of
it depends only on host facts except the drafts, which stay where the proposer put them: on a device,
they are scattered into the uploaded ids there (one ``index_copy_``). The result is a
:class:`~specsched.models.graph_buckets.HostInputs`: the graph scorers hand it to the runner (padded
into one upload), :func:`build_scoring_inputs_vec` uploads it as it is (eager scorers).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from specsched.engine.request import Request
from specsched.kernels.metadata import pad_block_tables
from specsched.models.graph_buckets import HostInputs
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
    rows = [  # (num_tokens, num_computed, blocks, last token) without the properties' calls
        (
            len(r.prompt_ids) + len(r.output_ids),
            r.num_computed,
            len(r.block_table),
            (r.output_ids or r.prompt_ids)[-1],
        )
        for r in batch
    ]
    facts = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=4 * b).reshape(b, 4)
    n, computed, lens, last = facts.T
    bad = np.flatnonzero(computed != n - 1)
    if bad.size:
        i = bad[0]
        raise RuntimeError(f"request {batch[i].request_id} is not decoding: {computed[i]} of {n[i]} computed")
    k = np.asarray(proposals.num_draft, dtype=np.int64).reshape(b)
    short = np.flatnonzero(lens * block_size < n + k)
    if short.size:
        i = short[0]
        raise ValueError(
            f"request {batch[i].request_id}: its block table of {lens[i]} blocks holds "
            f"{lens[i] * block_size} tokens, scoring {k[i]} drafts needs {n[i] + k[i]}"
        )
    return ScoringBatch(n, k, last, _padded_tables([r.block_table for r in batch], lens), block_size)


def _padded_tables(tables: list[list[int]], lens: np.ndarray) -> np.ndarray:  # [B, W] int32
    """:func:`~specsched.kernels.metadata.pad_block_tables` with the rows' lengths known: from 32 rows
    on, one copy of the concatenated rows through a mask instead of a row at a time (below that the
    mask's few numpy calls cost more than the rows' copies)."""
    if len(tables) < 32:
        return pad_block_tables(tables)
    width = int(lens.max(initial=0)) or 1
    out = np.zeros((len(tables), width), dtype=np.int32)
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    out[np.arange(width) < lens[:, None]] = flat  # row-major: each row's first lens[i] entries
    return out


def scoring_host_inputs(
    sb: ScoringBatch,
    draft_tokens: torch.Tensor,  # [sum k_i] int64, request-major (Proposals.draft_tokens)
    *,
    is_expanded: bool,
    scatter_drafts: bool | None = None,
) -> HostInputs:
    """The scoring inputs of :func:`build_scoring_inputs` on the host, computed from ``sb``. Drafts on
    the host are gathered into the ids here; drafts on a device stay there (``scatter_drafts``, by
    default when they are not on the host): the ids hold 0 at their tokens, and ``scatter_index``
    lists those tokens (in draft order) for one scatter on the device."""
    b, t, bs = sb.num_requests, sb.total_tokens, sb.block_size
    num_drafts = t - b
    if draft_tokens.shape != (num_drafts,):
        raise ValueError(
            f"draft_tokens must be [{num_drafts}] (sum of num_draft), got {tuple(draft_tokens.shape)}"
        )
    if num_drafts:
        q = sb.num_draft + 1
        cu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        req = np.repeat(np.arange(b), q)  # [T] request of each token
        j = np.arange(t) - cu[req]  # [T] index within the request
        positions = sb.num_tokens[req] - 1 + j
    else:  # no drafts (a non-speculative step): token i is request i's last, j = 0
        req, cu, j = np.arange(b), np.arange(b + 1), np.zeros(b, dtype=np.int64)
        positions = sb.num_tokens - 1
    slots = sb.block_tables[req, positions // bs].astype(np.int64) * bs + positions % bs
    is_draft = j > 0
    scatter = None
    if scatter_drafts is None:
        scatter_drafts = draft_tokens.device.type != "cpu"
    if not scatter_drafts:  # ids: last[req] at j == 0, then the request's drafts
        ids = sb.last_tokens[req]
        if num_drafts:
            ids[is_draft] = draft_tokens.numpy()
    else:
        ids = np.where(is_draft, 0, sb.last_tokens[req])
        scatter = np.flatnonzero(is_draft)
    if is_expanded:
        row_cu, seq_lens, tables = np.arange(t + 1), positions + 1, sb.block_tables[req]
    else:
        row_cu, seq_lens, tables = cu, sb.num_tokens + sb.num_draft, sb.block_tables
    return HostInputs(
        ids, positions, slots, row_cu, seq_lens, tables, sb.max_q(is_expanded), sb.max_k,
        scatter_index=scatter,
    )  # fmt: skip


def build_scoring_inputs_vec(
    sb: ScoringBatch,
    draft_tokens: torch.Tensor,  # [sum k_i] int64, request-major (Proposals.draft_tokens)
    device: torch.device | str,
    *,
    is_expanded: bool,
) -> ScoringInputs:
    """:func:`scoring_host_inputs` on ``device``: one host-to-device copy (plus one scatter of the
    drafts when they are on a device). On CUDA the tokens are padded to a token bucket (the first
    ``sum(k_i + 1)`` are the real ones)."""
    x = scoring_host_inputs(sb, draft_tokens, is_expanded=is_expanded)
    on_device = draft_tokens if x.scatter_index is not None else None
    device = torch.device(device)
    ids, pos, meta, _ = x.to_device(device, on_device, pad_tokens=device.type == "cuda")
    return ScoringInputs(input_ids=ids, positions=pos, meta=meta)
