"""Paged varlen attention: the backend registry and the torch reference.

Every backend has the signature of :func:`paged_attention_torch`; see ``metadata.py`` for the
row/key layout and the bottom-right causal mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from specsched.kernels.metadata import AttentionMetadata

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


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


def store_kv(
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Write each new token's K/V into its cache slot (in place, no host sync)."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention_torch(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Reference: gather each row's keys, SDPA with an explicit bottom-right causal mask.

    Loops over rows on the host: correct everywhere, fast nowhere. Used on CPU and as the
    oracle for the Triton and flash-attn backends.
    """
    check_attention_args(q, k_cache, v_cache, meta)
    bs = k_cache.shape[1]
    num_heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    cu = meta.cu_seqlens_q.tolist()
    k_lens = meta.seq_lens_k.tolist()
    tables = meta.block_tables
    for i, n_k in enumerate(k_lens):
        q0, q1 = cu[i], cu[i + 1]
        n_q = q1 - q0
        if n_q == 0:
            continue
        pos = torch.arange(n_k, device=q.device)
        blocks = tables[i, pos // bs].long()
        keys = k_cache[blocks, pos % bs]  # [n_k, kv_heads, D]
        vals = v_cache[blocks, pos % bs]
        if kv_heads != num_heads:
            keys = keys.repeat_interleave(num_heads // kv_heads, dim=1)
            vals = vals.repeat_interleave(num_heads // kv_heads, dim=1)
        q_pos = torch.arange(n_k - n_q, n_k, device=q.device)
        mask = pos[None, :] <= q_pos[:, None]  # [n_q, n_k] bottom-right causal
        o = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1), attn_mask=mask, scale=scale
        )
        out[q0:q1] = o.transpose(0, 1)
    return out


def _triton_backend() -> AttentionFn:
    from specsched.kernels.triton_attention import paged_attention_triton

    return paged_attention_triton


def _flash_attn_backend() -> AttentionFn:
    from specsched.kernels.flash_attention import paged_attention_flash

    return paged_attention_flash


_BACKENDS: dict[str, Callable[[], AttentionFn]] = {
    "torch": lambda: paged_attention_torch,
    "triton": _triton_backend,
    "flash_attn": _flash_attn_backend,
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(name: str) -> AttentionFn:
    """Look up an attention backend by its config name (``model.attn_backend``)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(available_backends())}")
    try:
        return _BACKENDS[name]()
    except ImportError as e:
        raise RuntimeError(f"attention backend {name!r} is not usable here: {e}") from e
