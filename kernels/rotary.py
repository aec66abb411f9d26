"""Rotary position embedding fused with the paged KV store: a Triton kernel and its torch reference.

Rotary embedding (RoPE; Su et al., 2021, "RoFormer"), in the rotate-half layout of HF Llama: a head
vector x of width D is split into halves (x1, x2) and, with c = cos(p * f), s = sin(p * f) for the
token's position p and the D/2 inverse frequencies f,

    rope(x) = concat(x1 * c - x2 * s, x2 * c + x1 * s)

computed in fp32 and rounded once to the model dtype. ``rotary_store_kv`` takes the fused qkv GEMM
output (``[q heads | k heads | v heads]`` along the last dimension), rotates q and k, writes the
rotated k and the unrotated v into the paged caches at ``slot_mapping`` (the contract of
``attention.store_kv``), and returns the rotated q. One program per token does all of it, so the
launch depends only on shapes and can be captured in a CUDA graph. Padding tokens of captured graphs
point at the reserved pad block 0 (``PAD_SLOT``); the kernel additionally skips negative slots
instead of writing out of bounds (the reference, ``index_copy_``, rejects them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specsched.kernels.attention import store_kv
from specsched.kernels.pdl import pdl_args, pdl_start
from specsched.kernels.triton_utils import (
    NO_FP_FUSION,
    check_float,
    check_launchable,
    emulate_bf16,
    next_pow2,
    round_to,
    row_major,
    runtime_args,
)

_MAX_TILE = 2048  # elements of one head-block tile (bounds registers per program)


def apply_rotary_ref(
    x: torch.Tensor,  # [T, heads, D]
    cos: torch.Tensor,  # [T, D/2] float32
    sin: torch.Tensor,  # [T, D/2] float32
) -> torch.Tensor:  # [T, heads, D], x.dtype
    """Rotate-half RoPE in fp32, rounded once to ``x.dtype`` (HF Llama)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rotary_store_kv_ref(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * D]
    cos: torch.Tensor,  # [T, D/2] float32
    sin: torch.Tensor,  # [T, D/2] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, D]
    slot_mapping: torch.Tensor,  # [T] int64
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:  # rotated q [T, num_heads, D]
    """Torch reference: split, ``apply_rotary_ref`` on q and k, ``store_kv`` of (rotated k, v)."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = apply_rotary_ref(q.reshape(t, num_heads, d), cos, sin)
    k = apply_rotary_ref(k.reshape(t, num_kv_heads, d), cos, sin)
    store_kv(k, v.reshape(t, num_kv_heads, d), k_cache, v_cache, slot_mapping)
    return q


@triton.jit
def _rope_heads(
    src_ptr, dst_ptr, c, s, offs_d, d_mask, limit,
    NUM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    """Rotate heads [0, limit) of a contiguous [NUM, HEAD_DIM] row into ``dst`` (same layout);
    ``limit`` is NUM, or 0 to skip the token."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = dst_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    for h0 in tl.static_range(0, NUM, BLOCK_H):
        h = h0 + offs_h
        mask = (h < limit)[:, None] & d_mask[None, :]
        off1 = h[:, None] * HEAD_DIM + offs_d[None, :]  # [BLOCK_H, HALF_PAD], first half
        x1 = tl.load(src_ptr + off1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src_ptr + off1 + HALF, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * c[None, :] - x2 * s[None, :]
        o2 = x2 * c[None, :] + x1 * s[None, :]
        tl.store(dst_ptr + off1, round_to(o1, dtype, EMULATE_BF16), mask=mask)
        tl.store(dst_ptr + off1 + HALF, round_to(o2, dtype, EMULATE_BF16), mask=mask)


@triton.jit(**runtime_args(pointers=("slot_ptr",)))
def _rotary_store_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_qkv, stride_cos, stride_sin, stride_q, stride_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_V: tl.constexpr,
    EMULATE_BF16: tl.constexpr, USE_PDL: tl.constexpr = False, TRIGGER_FIRST: tl.constexpr = False,
):  # fmt: skip
    pdl_start(USE_PDL, TRIGGER_FIRST)
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HEAD_DIM // 2
    c = tl.load(cos_ptr + t * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    _rope_heads(
        row, q_ptr + t * stride_q, c, s, offs_d, d_mask, NUM_HEADS,
        NUM_HEADS, HEAD_DIM, BLOCK_HQ, EMULATE_BF16,
    )  # fmt: skip
    slot = tl.load(slot_ptr + t)  # int64
    ok = slot >= 0  # negative slots are skipped (never produced by our metadata)
    slot_off = tl.where(ok, slot, 0) * stride_slot
    _rope_heads(
        row + NUM_HEADS * HEAD_DIM, kc_ptr + slot_off, c, s, offs_d, d_mask, tl.where(ok, NUM_KV_HEADS, 0),
        NUM_KV_HEADS, HEAD_DIM, BLOCK_HKV, EMULATE_BF16,
    )  # fmt: skip
    V_WIDTH: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    v_row = row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
    v_limit = tl.where(ok, V_WIDTH, 0)
    offs_v = tl.arange(0, BLOCK_V)
    for v0 in tl.static_range(0, V_WIDTH, BLOCK_V):
        v_mask = v0 + offs_v < v_limit
        v = tl.load(v_row + v0 + offs_v, mask=v_mask)
        tl.store(vc_ptr + slot_off + v0 + offs_v, v, mask=v_mask)


def _check(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    op = "rotary_store_kv"
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{op}: num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{op}: k_cache/v_cache must both be [num_blocks, block_size, kv_heads, head_dim], "
            f"got shapes {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    d = k_cache.shape[3]
    if k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"{op}: k_cache has {k_cache.shape[2]} kv heads, num_kv_heads is {num_kv_heads}")
    if d % 2 != 0 or d > 256:
        raise ValueError(f"{op}: head_dim must be even and <= 256, got cache shape {tuple(k_cache.shape)}")
    width = (num_heads + 2 * num_kv_heads) * d
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"{op}: qkv must be [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim = {width}], "
            f"got shape {tuple(qkv.shape)}"
        )
    t = qkv.shape[0]
    for name, cs in (("cos", cos), ("sin", sin)):
        if cs.shape != (t, d // 2):
            raise ValueError(f"{op}: {name} must be [num_tokens={t}, head_dim/2={d // 2}], got shape "
                             f"{tuple(cs.shape)}")  # fmt: skip
        if cs.dtype != torch.float32:
            raise ValueError(f"{op}: {name} must be float32, got {cs.dtype}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"{op}: slot_mapping must be [num_tokens={t}] int64, got shape {tuple(slot_mapping.shape)} "
            f"{slot_mapping.dtype}"
        )
    check_float(op, "qkv", qkv)
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError(
            f"{op}: cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must equal the qkv dtype {qkv.dtype}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op}: k_cache and v_cache must be contiguous")
    for name, other in (("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache),
                        ("slot_mapping", slot_mapping)):  # fmt: skip
        if other.device != qkv.device:
            raise ValueError(f"{op}: {name} is on {other.device}, qkv on {qkv.device}")


def _launch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    t, d = qkv.shape[0], k_cache.shape[3]
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device) if q_out is None else q_out
    if t == 0:
        return q
    qkv, cos, sin, slot_mapping = row_major(qkv), row_major(cos), row_major(sin), slot_mapping.contiguous()
    half_pad = next_pow2(d // 2)
    max_h = max(1, _MAX_TILE // half_pad)
    block_hq = min(next_pow2(num_heads), max_h)
    block_hkv = min(next_pow2(num_kv_heads), max_h)
    block_v = min(next_pow2(num_kv_heads * d), _MAX_TILE)
    _rotary_store_kv_kernel[(t,)](
        qkv, cos, sin, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), k_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=d, HALF_PAD=half_pad, BLOCK_HQ=block_hq,
        BLOCK_HKV=block_hkv, BLOCK_V=block_v, EMULATE_BF16=emulate_bf16(qkv.dtype),
        num_warps=8 if block_hq * half_pad >= 2048 else 4, **NO_FP_FUSION, **pdl_args(qkv.device),
    )  # fmt: skip
    return q


def _check_q_out(q_out: torch.Tensor | None, qkv: torch.Tensor, num_heads: int, d: int) -> None:
    if q_out is None:
        return
    want = (qkv.shape[0], num_heads, d)
    if tuple(q_out.shape) != want or q_out.dtype != qkv.dtype or not q_out.is_contiguous():
        raise ValueError(
            f"rotary_store_kv: q_out must be a contiguous {want} {qkv.dtype} tensor, got "
            f"{tuple(q_out.shape)} {q_out.dtype} (contiguous: {q_out.is_contiguous()})"
        )


def rotary_store_kv_triton(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * D]
    cos: torch.Tensor,  # [T, D/2] float32
    sin: torch.Tensor,  # [T, D/2] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, D], contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, D], contiguous
    slot_mapping: torch.Tensor,  # [T] int64
    num_heads: int,
    num_kv_heads: int,
    *,
    q_out: torch.Tensor | None = None,  # [T, num_heads, D] contiguous: the rotated q written here
) -> torch.Tensor:  # rotated q [T, num_heads, D]
    """One launch; CUDA tensors (or CPU under ``TRITON_INTERPRET=1``)."""
    _check(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
    check_launchable("rotary_store_kv", qkv=qkv)
    _check_q_out(q_out, qkv, num_heads, k_cache.shape[3])
    return _launch(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, q_out)


def rotary_store_kv(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * D]
    cos: torch.Tensor,  # [T, D/2] float32
    sin: torch.Tensor,  # [T, D/2] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, D], contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, D], contiguous
    slot_mapping: torch.Tensor,  # [T] int64 cache slots (graph padding: the pad block's slots)
    num_heads: int,
    num_kv_heads: int,
    *,
    q_out: torch.Tensor | None = None,  # [T, num_heads, D] contiguous: the rotated q written here
) -> torch.Tensor:  # rotated q [T, num_heads, D]
    """RoPE on q and k + KV store: the Triton kernel on CUDA, the torch reference elsewhere.
    ``q_out`` receives the rotated q (e.g. a static buffer read by the attention launched between two
    CUDA graphs, models/piecewise_graphs.py)."""
    _check(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
    _check_q_out(q_out, qkv, num_heads, k_cache.shape[3])
    if qkv.is_cuda:
        return _launch(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, q_out)
    q = rotary_store_kv_ref(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
    return q if q_out is None else q_out.copy_(q)
