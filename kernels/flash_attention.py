"""flash-attn backend: paged varlen attention through ``flash_attn.flash_attn_varlen_func``.

flash-attn (>= 2.6) takes the paged cache directly when given ``block_table``: K/V are then
``[num_blocks, page_block_size, kv_heads, head_dim]`` and ``cu_seqlens_k`` holds the prefix sums of
each row's key count (it is only used for lengths, not offsets). With ``causal=True`` its mask is
aligned to the bottom-right corner, which is our mask (see ``metadata.py``). Its paged path needs a
page (cache block) size that is a multiple of 256, fp16/bf16 inputs and head_dim a multiple of 8
up to 256.

This module imports ``flash_attn`` when it is itself imported, which the backend registry does only
when ``model.attn_backend == "flash_attn"``; where flash-attn is missing, the import raises
ImportError and the registry reports the backend as not usable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specsched.kernels.metadata import AttentionMetadata, check_attention_args

try:
    from flash_attn import flash_attn_varlen_func
except ImportError as e:
    raise ImportError(
        f"flash-attn is not installed ({e}); install flash-attn>=2.6 on a CUDA machine "
        f"or use attn_backend 'triton' or 'torch'"
    ) from e

PAGE_MULTIPLE = 256  # flash-attn's paged KV path needs block_size % 256 == 0


def check_flash_args(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """The limits of flash-attn's paged varlen path, as clear errors before the launch."""
    block_size, head_dim = k_cache.shape[1], q.shape[-1]
    if block_size % PAGE_MULTIPLE != 0:
        raise ValueError(
            f"flash-attn's paged path needs a cache block size that is a multiple of {PAGE_MULTIPLE}, "
            f"got {block_size}; set the block size accordingly or use attn_backend 'triton'"
        )
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"flash-attn supports float16 and bfloat16 only, got {q.dtype}")
    if head_dim % 8 != 0 or head_dim > 256:
        raise ValueError(f"flash-attn needs head_dim a multiple of 8 and at most 256, got {head_dim}")
    if not q.is_cuda:
        raise ValueError(f"flash-attn needs CUDA tensors, got {q.device}")
    for name in ("cu_seqlens_q", "seq_lens_k", "block_tables"):
        t = getattr(meta, name)
        if t.dtype != torch.int32:
            raise ValueError(f"meta.{name} must be int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"meta.{name} is on {t.device}, q on {q.device}")


def paged_attention_flash(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim], filled in place when given
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Paged varlen attention with the signature of ``paged_attention_torch`` (no host sync)."""
    check_attention_args(q, k_cache, v_cache, meta)
    check_flash_args(q, k_cache, meta)
    if meta.max_q <= 0 or q.shape[0] == 0:
        return torch.empty_like(q) if out is None else out
    # cu_seqlens_k [B+1]: prefix sums of keys per row, computed on the device.
    cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens_k, 0, dtype=torch.int32), (1, 0))
    result = flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        meta.cu_seqlens_q,
        cu_seqlens_k,
        meta.max_q,
        meta.max_k,
        softmax_scale=scale,
        causal=True,
        block_table=meta.block_tables,
    )
    if out is None:
        return result
    return out.copy_(result)
