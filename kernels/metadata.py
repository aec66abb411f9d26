"""Attention metadata shared by every attention backend, scorer and model forward.

A batch is a list of *rows*. Row i contributes ``q_len_i = cu_seqlens_q[i+1] - cu_seqlens_q[i]`` new
query tokens and attends to ``seq_lens_k[i]`` keys: its cached prefix plus its new tokens, with
bottom-right causal masking (new token j of row i sees keys ``[0, seq_lens_k[i] - q_len_i + j]``).
Keys live in a paged cache ``[num_blocks, block_size, kv_heads, head_dim]``; key position p of row i
is slot ``block_tables[i, p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # [B+1] int32, prefix sums of query lengths
    seq_lens_k: torch.Tensor  # [B] int32, keys per row (cached prefix + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks] int32, block ids per row (pad with 0)
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token's K/V
    max_q: int  # host int: max query length over rows (an upper bound when captured)
    max_k: int  # host int: max keys over rows (an upper bound when captured)

    @property
    def num_rows(self) -> int:
        return self.seq_lens_k.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def to(self, device: torch.device | str) -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q.to(device, non_blocking=True),
            seq_lens_k=self.seq_lens_k.to(device, non_blocking=True),
            block_tables=self.block_tables.to(device, non_blocking=True),
            slot_mapping=self.slot_mapping.to(device, non_blocking=True),
            max_q=self.max_q,
            max_k=self.max_k,
        )


def metadata_from_host(
    cu_seqlens_q: np.ndarray,  # [B+1] int
    seq_lens_k: np.ndarray,  # [B] int
    block_tables: np.ndarray,  # [B, max_blocks] int
    slot_mapping: torch.Tensor,  # [T] int64, already on ``device``
    max_q: int,
    max_k: int,
    device: torch.device | str,
) -> AttentionMetadata:
    """Metadata from host arrays: the int32 fields travel in one host-to-device copy (views of one
    buffer), no device sync."""
    rows, width = block_tables.shape
    host = np.concatenate([cu_seqlens_q, seq_lens_k, block_tables.ravel()]).astype(np.int32, copy=False)
    buf = torch.from_numpy(host).to(device, non_blocking=True)
    return AttentionMetadata(
        cu_seqlens_q=buf[: rows + 1],
        seq_lens_k=buf[rows + 1 : 2 * rows + 1],
        block_tables=buf[2 * rows + 1 :].view(rows, width),
        slot_mapping=slot_mapping,
        max_q=max_q,
        max_k=max_k,
    )


def pad_block_tables(block_tables: list[list[int]]) -> np.ndarray:  # [B, max_blocks] int32
    """Rows padded with 0 (the reserved pad block) to the longest; at least one column."""
    width = max(map(len, block_tables), default=0) or 1
    out = np.zeros((len(block_tables), width), dtype=np.int32)
    for i, table in enumerate(block_tables):
        out[i, : len(table)] = table
    return out


def host_metadata(
    q_lens: Sequence[int] | np.ndarray,
    k_lens: Sequence[int] | np.ndarray,
    block_tables: list[list[int]],
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The metadata arrays of :func:`build_metadata` on the host, vectorised: ``cu_seqlens_q``
    [B+1] int64, ``seq_lens_k`` [B] int64, ``block_tables`` [B, W] int32 and ``slot_mapping`` [T]
    int64. Checks every row (clear error for the first bad one)."""
    if not (len(q_lens) == len(k_lens) == len(block_tables)):
        raise ValueError(
            f"q_lens, k_lens and block_tables differ in length: "
            f"{len(q_lens)}, {len(k_lens)}, {len(block_tables)}"
        )
    q = np.asarray(q_lens, dtype=np.int64).reshape(-1)
    k = np.asarray(k_lens, dtype=np.int64).reshape(-1)
    tables = pad_block_tables(block_tables)
    num_blocks = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    bad_q, bad_k = (q < 0) | (k < q), k > num_blocks * block_size
    if (bad_q | bad_k).any():
        i = int(np.argmax(bad_q | bad_k))  # the first bad row, its first problem
        if bad_q[i]:
            raise ValueError(f"row needs 0 <= q_len <= k_len, got q_len={q[i]}, k_len={k[i]}")
        raise ValueError(f"row with {k[i]} keys needs {-(-k[i] // block_size)} blocks, has {num_blocks[i]}")
    cu = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    row = np.repeat(np.arange(len(q)), q)  # [T] row of each new token
    pos = np.arange(int(cu[-1])) - cu[row] + (k - q)[row]  # [T] key position of each new token
    slots = tables[row, pos // block_size].astype(np.int64) * block_size + pos % block_size
    return cu, k, tables, slots


def build_metadata(
    q_lens: Sequence[int] | np.ndarray,
    k_lens: Sequence[int] | np.ndarray,
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build metadata from plain lists (vectorised on the host, two copies to ``device``).

    ``q_lens[i]`` new tokens of row i sit at key positions ``k_lens[i]-q_lens[i] .. k_lens[i]-1``;
    their K/V slots come from ``block_tables[i]``.
    """
    cu, k, tables, slots = host_metadata(q_lens, k_lens, block_tables, block_size)
    return metadata_from_host(
        cu, k, tables, torch.from_numpy(slots).to(device, non_blocking=True),
        max_q=int(np.diff(cu).max(initial=0)), max_k=int(k.max(initial=0)), device=device,
    )  # fmt: skip


def check_attention_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Shape/dtype checks shared by every backend's wrapper."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_blocks, block_size, kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"head_dim differs: q {q.shape[-1]}, cache {k_cache.shape[-1]}")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of kv_heads {k_cache.shape[2]}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"dtype differs: q {q.dtype}, cache {k_cache.dtype}")
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens, metadata {meta.num_tokens}")
