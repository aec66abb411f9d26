"""Paged varlen attention: the backend registry and the torch reference.

Every backend has the signature of :func:`paged_attention_torch`; see ``metadata.py`` for the
row/key layout and the bottom-right causal mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from specsched.kernels.metadata import AttentionMetadata, check_attention_args

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


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
    *,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim], filled in place when given
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Reference: gather every row's keys into a padded batch, one SDPA call with an explicit
    bottom-right causal mask. No host sync (uses the host ints ``max_q``/``max_k``); correct
    everywhere, used on CPU and as the oracle for the Triton and flash-attn backends.
    """
    check_attention_args(q, k_cache, v_cache, meta)
    num_tokens, num_heads, head_dim = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_rows, max_q, max_k = meta.num_rows, max(meta.max_q, 1), max(meta.max_k, 1)
    dev = q.device
    q_lens = meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]  # [B]
    k_lens = meta.seq_lens_k.long()  # [B]
    # token t belongs to row r(t) at query offset j(t); padding tokens (past cu_seqlens_q[-1], as in
    # captured graphs) map to a dummy slot whose output is discarded
    t = torch.arange(num_tokens, device=dev)
    cu = meta.cu_seqlens_q.long()
    row = torch.searchsorted(cu[1:], t, right=True).clamp(max=num_rows - 1)
    j = t - cu[row]
    flat = torch.where(j < q_lens[row], row * max_q + j.clamp(max=max_q - 1), num_rows * max_q)
    qp = q.new_zeros(num_rows * max_q + 1, num_heads, head_dim)
    qp[flat] = q
    qp = qp[:-1].view(num_rows, max_q, num_heads, head_dim)
    pos = torch.arange(max_k, device=dev)  # [max_k]
    blocks = meta.block_tables[:, (pos // bs).clamp(max=meta.block_tables.shape[1] - 1)].long()  # [B, max_k]
    keys = k_cache[blocks, pos % bs]  # [B, max_k, kv_heads, D]
    vals = v_cache[blocks, pos % bs]
    if kv_heads != num_heads:
        keys = keys.repeat_interleave(num_heads // kv_heads, dim=2)
        vals = vals.repeat_interleave(num_heads // kv_heads, dim=2)
    q_pos = (k_lens - q_lens.long())[:, None] + torch.arange(max_q, device=dev)[None, :]  # [B, max_q]
    mask = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < k_lens[:, None, None])
    o = F.scaled_dot_product_attention(
        qp.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask[:, None], scale=scale
    )  # [B, H, max_q, D]
    o = torch.cat(
        [
            o.transpose(1, 2).reshape(num_rows * max_q, num_heads, head_dim),
            q.new_zeros(1, num_heads, head_dim),
        ]
    )
    o = o[flat]
    return o if out is None else out.copy_(o)


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
