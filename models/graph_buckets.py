"""Graph buckets: the shapes CUDA graphs are captured at, and padding a batch up to one.

A :class:`GraphBucket` is one captured shape (rows, tokens, max_q). Decode buckets (rows == tokens,
q_len 1) serve plain decode, batch-expansion scoring and a draft model's single-token steps; MQA
buckets capture ``max_q`` (the longest row) as an upper bound. Sizes follow :func:`size_ladder`.

Padding layout (a real batch of r rows / t tokens in a bucket of R rows / T tokens; see
:func:`pad_inputs`):

- tokens t..T-1 are pad tokens: input id 0, position 0, KV slot 0 (block 0 is reserved as the pad
  target and never given to a request);
- rows r..R-1 are pad rows: the first min(R-r, T-t) own one pad token each (q_len 1, seq_len_k 1,
  block table all 0, so each attends to key 0 of block 0), the rest have q_len 0 and seq_len_k 0
  (the attention kernel skips them). Pad tokens beyond the pad rows belong to no row: their
  attention output is left unwritten, but every other op is per token and their K/V land in block
  0, which no real row's visible keys reach, so real rows never see them;
- block-table columns beyond the real width are 0; ``max_q``/``max_k`` are the captured bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specsched.kernels.metadata import AttentionMetadata

PAD_SLOT = 0  # block 0, offset 0: the reserved pad block


@dataclass(frozen=True)
class GraphBucket:
    """One captured shape: ``rows`` attention rows, ``tokens`` tokens, any row's q_len <= ``max_q``."""

    rows: int
    tokens: int
    max_q: int

    def __post_init__(self) -> None:
        if self.rows < 1 or self.tokens < 1 or self.max_q < 1:
            raise ValueError(f"graph bucket needs rows, tokens, max_q >= 1, got {self}")
        if self.tokens > self.rows * self.max_q:
            raise ValueError(f"graph bucket {self} can never be filled: tokens > rows * max_q")

    @property
    def is_decode(self) -> bool:
        return self.max_q == 1

    def fits(self, rows: int, tokens: int, max_q: int) -> bool:
        return rows <= self.rows and tokens <= self.tokens and max_q <= self.max_q


def size_ladder(max_size: int) -> list[int]:
    """Bucket sizes 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... (powers of two, and 1.5x them from 16 on)
    below ``max_size``, then ``max_size`` itself."""
    if max_size < 1:
        raise ValueError(f"max bucket size must be >= 1, got {max_size}")
    out, p = [], 1
    while p < max_size:
        out.append(p)
        if p >= 16 and p * 3 // 2 < max_size:
            out.append(p * 3 // 2)
        p *= 2
    return [*out, max_size]


def decode_buckets(max_rows: int) -> list[GraphBucket]:
    """Single-query rows (decode, batch expansion, draft steps): rows == tokens, q_len 1."""
    return [GraphBucket(n, n, 1) for n in size_ladder(max_rows)]


def mqa_buckets(max_rows: int, max_q: int) -> list[GraphBucket]:
    """Varlen rows with q_len <= ``max_q``: for each row count R of the ladder, token counts of the
    ladder between R (exclusive: that is a decode bucket) and R * max_q (inclusive)."""
    if max_q < 2:
        raise ValueError(f"MQA buckets need max_q >= 2 (max_k >= 1), got {max_q}")
    return [
        GraphBucket(r, t, min(max_q, t))
        for r in size_ladder(max_rows)
        for t in size_ladder(r * max_q)
        if t > r
    ]


def as_bucket(b: GraphBucket | tuple[int, ...]) -> GraphBucket:
    """A bucket from a tuple: (rows, tokens) is decode when rows == tokens, else q_len <= tokens."""
    if isinstance(b, GraphBucket):
        return b
    if len(b) == 3:
        return GraphBucket(*b)
    if len(b) != 2:
        raise ValueError(f"a bucket is (rows, tokens) or (rows, tokens, max_q), got {b!r}")
    rows, tokens = b
    return GraphBucket(rows, tokens, 1 if rows == tokens else tokens)


def pad_inputs(
    input_ids: torch.Tensor,  # [t] int64
    positions: torch.Tensor,  # [t] int64
    meta: AttentionMetadata,  # r rows, t tokens
    rows: int,
    tokens: int,
    width: int,  # block-table columns of the bucket
    max_q: int,
    max_k: int,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:  # [tokens], [tokens], meta of `rows` rows
    """Pad a real batch to a bucket's shapes with the layout of the module docstring (no host sync)."""
    r, t, w = meta.num_rows, meta.num_tokens, meta.block_tables.shape[1]
    if rows < r or tokens < t or width < w:
        raise ValueError(f"cannot pad {r} rows / {t} tokens / width {w} into {rows} / {tokens} / {width}")
    pad_rows, pad_tokens = rows - r, tokens - t
    dev = meta.seq_lens_k.device
    owned = torch.arange(1, pad_rows + 1, dtype=torch.int32, device=dev).clamp_(max=pad_tokens)  # [pad_rows]
    cu_tail = owned + meta.cu_seqlens_q[-1:]  # cu_seqlens_q[-1] == t
    seq_tail = (torch.arange(pad_rows, dtype=torch.int32, device=dev) < pad_tokens).to(torch.int32)
    padded = AttentionMetadata(
        cu_seqlens_q=torch.cat([meta.cu_seqlens_q, cu_tail]),
        seq_lens_k=torch.cat([meta.seq_lens_k, seq_tail]),
        block_tables=F.pad(meta.block_tables, (0, width - w, 0, pad_rows)),
        slot_mapping=F.pad(meta.slot_mapping, (0, pad_tokens), value=PAD_SLOT),
        max_q=max_q,
        max_k=max_k,
    )
    return F.pad(input_ids, (0, pad_tokens)), F.pad(positions, (0, pad_tokens)), padded
