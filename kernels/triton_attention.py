"""Triton paged varlen attention (bottom-right causal, GQA) and a Triton KV store.

One launch serves any mix of rows: decode and batch-expansion rows (q_len 1), MQA rows (q_len k+1)
and prefill chunks (long q_len); see ``metadata.py`` for the layout. The grid is sized from host
upper bounds only (``meta.num_rows``, ``meta.max_q``) and every per-row length is read inside the
kernel, so a launch has no host synchronisation and can be captured in a CUDA graph and replayed
with new metadata contents of the same shapes. Rows with q_len 0 (padding) write nothing.

Program (row, q-tile, kv-head) handles ``BLOCK_Q`` query tokens of one row times the ``GROUP``
query heads that share one KV head, flattened into ``BLOCK_M = BLOCK_Q * GROUP_PAD`` matrix rows,
so each K/V tile is loaded once per group. It walks the row's keys in tiles of ``BLOCK_N``
(gathered through the block table, so ``BLOCK_N`` and the cache block size are independent) with
the online softmax of FlashAttention (Dao et al., 2022; Milakov & Gimelshein, 2018) in fp32: a
running max ``m``, a running normaliser ``l`` and an unnormalised accumulator ``acc`` that is
rescaled by ``exp(m_old - m_new)`` whenever the max grows. Keys before the tile's first query
position are visible to every query of the tile and take an unmasked loop; the rest take a masked
loop up to the causal limit of the tile's last query.

Split-KV (flash-decoding; Dao et al., 2023, "Flash-Decoding for long-context inference"): when the
grid above would leave SMs idle (few rows, long keys), each program takes one of ``NUM_SPLITS``
key chunks and writes its partial (m, l, acc) to an fp32 workspace; ``_combine_splits_kernel``
merges them per (token, head) as ``sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``. The split
count is fixed from host bounds, so the split path is graph-capturable too.

Deterministic mode (``model.deterministic``; ``launch_config(..., deterministic=True)``): a query's
output must not depend on the launch it is in (decode row, batch-expansion row, one of the k+1
queries of an MQA row, a prefill chunk; the batch; ``max_k``; the SM count). Its value is fixed by
the key tiles it is reduced over and by the tile shapes, so the config fixes them all from
(group, head_dim) alone: one query tile (``BLOCK_M = max(16, GROUP_PAD)``), one key tile, and key
splits at fixed positions, ``DETERMINISTIC_SPLIT_KEYS`` keys each (split s takes keys
[s * SPLIT_KEYS, (s + 1) * SPLIT_KEYS)); the split count, ``cdiv(max_k, SPLIT_KEYS)``, is a runtime
argument, so it adds no compiled variants. ``_combine_fixed_splits_kernel`` merges the splits one by
one in split order over the splits that hold the query's keys (its ``cdiv(q_pos + 1, SPLIT_KEYS)``
first ones, counted by the split-0 program into an int32 workspace): the splits past them would add
exact zeros, so skipping them (and the programs of splits with no key for any query of their tile,
which return at once) changes no bit, while a graph captured at ``max_k`` = the model length no
longer pays for its 32 mostly empty splits. A query whose keys fit one split gets ``acc / l``
bitwise as from an unsplit launch. Tiles past a query's causal limit
add exact zeros too (p = 0, alpha = 1), so which other queries share its tile does not matter. Every
key tile takes the masked code path (one arithmetic for every tile: the unmasked path's FMA
contraction differs on the GPU, and which tiles took it depended on the query tile's start).
"""

from __future__ import annotations

import functools

import torch
from triton.runtime.interpreter import InterpretedFunction

from specsched.kernels.attention_config import (  # noqa: F401 -- importers reach them here
    DETERMINISTIC_SPLIT_KEYS,
    LaunchConfig,
    deterministic_launch_config,
    deterministic_launch_configs,
    launch_config,
)
from specsched.kernels.metadata import AttentionMetadata, check_attention_args
from specsched.kernels.pdl import pdl_args
from specsched.kernels.triton_attention_kernels import (  # noqa: F401 -- the compile tests reach them here
    _attn_tile,
    _combine_fixed_splits_kernel,
    _combine_splits_kernel,
    _paged_attn_kernel,
    _store_kv_kernel,
)
from specsched.kernels.triton_utils import FP_FUSION, cdiv, next_pow2

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_interpreted() -> bool:
    """True when Triton was imported with ``TRITON_INTERPRET=1`` (kernels run on CPU via numpy)."""
    return isinstance(_paged_attn_kernel, InterpretedFunction)


def _check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    if device.type != "cuda" and not is_interpreted():
        raise RuntimeError(
            f"the Triton backend needs CUDA tensors, got {device}; on CPU use backend 'torch' "
            f"(or set TRITON_INTERPRET=1 before triton is first imported)"
        )
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on {device}, got one on {t.device}")


def _check_metadata(meta: AttentionMetadata) -> None:
    for name in ("cu_seqlens_q", "seq_lens_k", "block_tables"):
        t = getattr(meta, name)
        if t.dtype != torch.int32:
            raise ValueError(f"meta.{name} must be int32, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"meta.{name} must be contiguous in its last dimension")
    if meta.cu_seqlens_q.dim() != 1 or meta.cu_seqlens_q.shape[0] != meta.num_rows + 1:
        raise ValueError(
            f"meta.cu_seqlens_q must be [num_rows+1] = [{meta.num_rows + 1}], "
            f"got {tuple(meta.cu_seqlens_q.shape)}"
        )
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != meta.num_rows:
        raise ValueError(
            f"meta.block_tables must be [num_rows={meta.num_rows}, max_blocks], "
            f"got {tuple(meta.block_tables.shape)}"
        )


def paged_attention_triton(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim], written in place when given
    config: LaunchConfig | None = None,  # tile sizes and splits; from ``launch_config`` by default
    deterministic: bool = False,  # a query's output independent of the launch (module docstring)
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Paged varlen attention with the signature of ``paged_attention_torch``; no host sync.

    One launch (two with split-KV). Tokens of ``q`` past ``cu_seqlens_q[-1]`` and rows with
    q_len 0 are left untouched in ``out``. ``meta.max_q`` must be an upper bound of every row's
    q_len (queries past it are not computed); ``meta.max_k`` only steers the split count (in
    deterministic mode it must also bound every row's keys: it sets how many fixed splits run).
    """
    check_attention_args(q, k_cache, v_cache, meta)
    _check_metadata(meta)
    if deterministic and config is not None and not config.is_deterministic:
        raise ValueError("deterministic=True needs a deterministic config (deterministic_launch_config)")
    if q.dtype not in _DTYPES:
        raise ValueError(f"dtype {q.dtype} not supported; use one of {_DTYPES}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride(-1) == 1)")
    _check_device(q, k_cache, v_cache, out, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables)
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if meta.num_rows == 0 or meta.max_q <= 0 or num_tokens == 0:
        return out
    if config is None and deterministic:
        config = deterministic_launch_config(meta.max_k, num_heads // kv_heads, head_dim)
    elif config is None:
        config = launch_config(
            meta.max_q, meta.max_k, meta.num_rows, num_heads // kv_heads, kv_heads, head_dim,
            num_sms=_num_sms(q.device),
        )  # fmt: skip
    cfg, splits = config, config.num_splits
    fixed = cfg.is_deterministic
    if splits > 1:  # split partials: (m, l) pairs [T, H, S, 2] and acc [T, H, S, BLOCK_D], fp32
        ws = (num_tokens, num_heads, splits)
        ws_ml = q.new_empty((*ws, 2), dtype=torch.float32)
        ws_acc = q.new_empty((*ws, cfg.block_d), dtype=torch.float32)
        # deterministic split path: each token's number of splits with keys (written by split 0)
        ws_nv = q.new_empty((num_tokens if fixed else 1,), dtype=torch.int32)
    else:  # an unsplit launch never touches them (NUM_SPLITS == 1 compiles their stores out)
        ws_ml, ws_acc, ws_nv = _unused_workspaces(q.device)
    # The interpreter (triton 3.9) gets tl.dot wrong on bf16 operands: compute those dots in fp32.
    upcast = q.dtype == torch.bfloat16 and is_interpreted()
    grid = (meta.num_rows, cdiv(meta.max_q, cfg.block_q), kv_heads * splits)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, out, meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables, ws_ml, ws_acc,
        ws_nv, float(scale) * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0), splits,
        GROUP=num_heads // kv_heads, GROUP_PAD=cfg.group_pad, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
        PAGE=k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_D=cfg.block_d,
        NUM_SPLITS=min(splits, 2) if fixed else splits,
        NUM_HEADS=num_heads, PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast, SPLIT_KEYS=cfg.split_keys, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **FP_FUSION, **pdl_args(q.device),
    )  # fmt: skip
    if splits > 1 and fixed:
        _combine_fixed_splits_kernel[(num_tokens, num_heads)](
            out, meta.cu_seqlens_q, ws_ml, ws_acc, ws_nv, meta.num_rows, splits, out.stride(0),
            out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=cfg.block_d, **FP_FUSION,
        )  # fmt: skip
    elif splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            out, meta.cu_seqlens_q, ws_ml, ws_acc, meta.num_rows, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=splits, SPLITS_PAD=next_pow2(splits),
            HEAD_DIM=head_dim, BLOCK_D=cfg.block_d, **FP_FUSION, **pdl_args(q.device),
        )  # fmt: skip
    return out


_UNUSED_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _unused_workspaces(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Placeholders for the split workspaces of an unsplit launch, one set per device (three fewer
    allocations a launch; an eager forward makes one per layer). Fresh ones while a CUDA graph is
    being captured, so that no cached tensor lives in a graph's private memory pool."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _new_workspaces(device)
    if device not in _UNUSED_WORKSPACES:
        _UNUSED_WORKSPACES[device] = _new_workspaces(device)
    return _UNUSED_WORKSPACES[device]


def _new_workspaces(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    f32 = torch.float32
    return (
        torch.empty((1, 2), dtype=f32, device=device),
        torch.empty((1, 16), dtype=f32, device=device),
        torch.empty((1,), dtype=torch.int32, device=device),
    )


@functools.cache
def _num_sms_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreted runs: a nominal H100/H200 count
    return _num_sms_cached(device.index if device.index is not None else torch.cuda.current_device())


def store_kv_triton(
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [T] int64; a negative slot skips its token
) -> None:
    """Triton twin of ``store_kv``: one launch writes K and V of every token into its slot."""
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"k/v must both be [T, kv_heads, head_dim] matching cache {tuple(k_cache.shape)}, "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache differ in shape or dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (k.shape[0],):
        raise ValueError(
            f"slot_mapping must be [{k.shape[0]}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    _check_device(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    k2, v2 = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
    if k2.stride(1) != 1 or v2.stride(1) != 1:
        k2, v2 = k2.contiguous(), v2.contiguous()
    row = k2.shape[1]
    _store_kv_kernel[(k.shape[0],)](
        k2, v2, k_cache, v_cache, slot_mapping, k2.stride(0), v2.stride(0), k_cache.stride(1),
        ROW=row, BLOCK=next_pow2(row), **FP_FUSION,
    )  # fmt: skip
