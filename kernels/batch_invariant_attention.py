"""Attention for deterministic mode (``model.deterministic``): the backends whose output for a query
does not depend on the launch it is in, and a per-query torch path for CPU.

- ``triton``: :func:`~specsched.kernels.triton_attention.paged_attention_triton` with
  ``deterministic=True`` (fixed tiles, keys split at fixed positions; see that module's docstring).
  Used on CUDA, in the eager forwards and in every captured graph alike.
- ``torch``: :func:`paged_attention_per_query`, one query at a time. Every op on a query's data has
  a shape fixed by the query's key count alone (p + 1 keys for the query at key position p), so its
  output is bitwise the same whatever batch, row or q_len it comes in, given the same CPU thread
  count. It reads the metadata on the host (a sync per call) and loops in Python: for CPU tests and
  development only. It is not bitwise equal to the Triton path, so one process uses one of them.
- ``flash_attn`` has no such mode (its split-KV heuristic reads the batch).
"""

from __future__ import annotations

import functools

import torch

from specsched.kernels.attention import AttentionFn
from specsched.kernels.metadata import AttentionMetadata, check_attention_args

DETERMINISTIC_BACKENDS = ("triton", "torch")


def paged_attention_per_query(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]; tokens of no row (padding) are zeros
    """Bottom-right causal paged attention, each query alone, in fp32, rounded once to ``q.dtype``."""
    check_attention_args(q, k_cache, v_cache, meta)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.zeros_like(q)
    cu, k_lens = meta.cu_seqlens_q.tolist(), meta.seq_lens_k.tolist()
    for r in range(meta.num_rows):
        q_len, k_len = cu[r + 1] - cu[r], k_lens[r]
        if q_len <= 0:
            continue
        blocks = meta.block_tables[r, : -(-k_len // block_size)].long()
        # [k_len, num_heads, head_dim] fp32, fresh tensors: a query's prefix of them is the same
        # tensor (values, strides, alignment) whatever the row's k_len
        keys = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:k_len].float()
        vals = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:k_len].float()
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
        for j in range(q_len):
            n = k_len - q_len + j + 1  # the keys this query sees
            qt = q[cu[r] + j].float() * scale  # [num_heads, head_dim]
            s = (keys[:n] * qt[None]).sum(-1)  # [n, num_heads]
            e = (s - s.max(0, keepdim=True).values).exp()
            o = (vals[:n] * e[:, :, None]).sum(0) / e.sum(0)[:, None]  # [num_heads, head_dim]
            out[cu[r] + j] = o.to(q.dtype)
    return out


def deterministic_attention_backend(name: str) -> AttentionFn:
    """The deterministic variant of attention backend ``name`` (``model.attn_backend``)."""
    if name == "triton":
        from specsched.kernels.triton_attention import paged_attention_triton

        return functools.partial(paged_attention_triton, deterministic=True)
    if name == "torch":
        return paged_attention_per_query
    raise ValueError(
        f"attention backend {name!r} has no deterministic mode; model.deterministic needs one of "
        f"{', '.join(DETERMINISTIC_BACKENDS)}"
    )
