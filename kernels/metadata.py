"""Attention metadata shared by every attention backend, scorer and model forward.

A batch is a list of *rows*. Row i contributes ``q_len_i = cu_seqlens_q[i+1] - cu_seqlens_q[i]`` new
query tokens and attends to ``seq_lens_k[i]`` keys: its cached prefix plus its new tokens, with
bottom-right causal masking (new token j of row i sees keys ``[0, seq_lens_k[i] - q_len_i + j]``).
Keys live in a paged cache ``[num_blocks, block_size, kv_heads, head_dim]``; key position p of row i
is slot ``block_tables[i, p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def build_metadata(
    q_lens: list[int],
    k_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build metadata from plain lists (host side, one copy to ``device``).

    ``q_lens[i]`` new tokens of row i sit at key positions ``k_lens[i]-q_lens[i] .. k_lens[i]-1``;
    their K/V slots come from ``block_tables[i]``.
    """
    if not (len(q_lens) == len(k_lens) == len(block_tables)):
        raise ValueError(
            f"q_lens, k_lens and block_tables differ in length: "
            f"{len(q_lens)}, {len(k_lens)}, {len(block_tables)}"
        )
    cu = [0]
    slots: list[int] = []
    for q, k, table in zip(q_lens, k_lens, block_tables):
        if q < 0 or k < q:
            raise ValueError(f"row needs 0 <= q_len <= k_len, got q_len={q}, k_len={k}")
        if k > len(table) * block_size:
            raise ValueError(f"row with {k} keys needs {-(-k // block_size)} blocks, has {len(table)}")
        cu.append(cu[-1] + q)
        for p in range(k - q, k):
            slots.append(table[p // block_size] * block_size + p % block_size)
    max_blocks = max((len(t) for t in block_tables), default=0) or 1
    bt = torch.zeros(len(block_tables), max_blocks, dtype=torch.int32)
    for i, t in enumerate(block_tables):
        if t:
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens_k=torch.tensor(k_lens, dtype=torch.int32),
        block_tables=bt,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_q=max(q_lens, default=0),
        max_k=max(k_lens, default=0),
    ).to(device)
