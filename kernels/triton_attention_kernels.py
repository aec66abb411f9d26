"""The ``@triton.jit`` kernels of :mod:`specsched.kernels.triton_attention` (its docstring describes
them): paged varlen attention over one tile of queries (``_paged_attn_kernel``, split-KV optional),
the merges of its splits (``_combine_splits_kernel``; ``_combine_fixed_splits_kernel`` in
deterministic mode) and the KV store. Launched only through that module's wrappers."""

from __future__ import annotations

import triton
import triton.language as tl

from specsched.kernels.pdl import pdl_start
from specsched.kernels.triton_utils import runtime_args


@triton.jit
def _attn_tile(
    acc, m_i, l_i, q, k_ptr, v_ptr, bt_row_ptr, start, kv_end, q_pos, offs_d, d_valid,
    stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys ``start .. start+BLOCK_N-1`` of the row."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_valid = offs_n < kv_end
        blk = tl.load(bt_row_ptr + offs_n // PAGE, mask=n_valid, other=0).to(tl.int64)
        kv_mask = n_valid[:, None] & d_valid[None, :]
    else:
        blk = tl.load(bt_row_ptr + offs_n // PAGE).to(tl.int64)
        kv_mask = d_valid[None, :] & (offs_n[:, None] >= 0)
    in_page = (offs_n % PAGE).to(tl.int64)
    k_off = blk * stride_kb + in_page * stride_ks
    v_off = blk * stride_vb + in_page * stride_vs
    k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    if UPCAST:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N] fp32
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit(**runtime_args(ints=("stride_bt", "num_splits"), pointers=("cu_q_ptr", "seq_k_ptr", "bt_ptr")))
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, seq_k_ptr, bt_ptr, ws_ml_ptr, ws_acc_ptr, ws_nv_ptr, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    NUM_HEADS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    USE_PDL: tl.constexpr = False, TRIGGER_FIRST: tl.constexpr = False,
):  # fmt: skip
    pdl_start(USE_PDL, TRIGGER_FIRST)
    # SPLIT_KEYS > 0: deterministic mode, keys split at multiples of SPLIT_KEYS; NUM_SPLITS is then
    # 1 (unsplit) or 2 (split; the count is the runtime num_splits). SPLIT_KEYS == 0: NUM_SPLITS
    # chunks sized from the tile's keys (num_splits unused).
    row = tl.program_id(0)
    q_start = tl.program_id(1) * BLOCK_Q  # first query index (within the row) of this tile
    if SPLIT_KEYS == 0:
        n_splits = NUM_SPLITS
    else:
        n_splits = num_splits
    kvh = tl.program_id(2) // n_splits
    split = tl.program_id(2) % n_splits
    q_begin = tl.load(cu_q_ptr + row)
    q_len = tl.load(cu_q_ptr + row + 1) - q_begin
    if q_start >= q_len:  # padding row, or a tile past this row's queries
        return
    k_len = tl.load(seq_k_ptr + row)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_start + offs_m // GROUP_PAD  # query index within the row
    head = kvh * GROUP + offs_m % GROUP_PAD  # query head
    m_valid = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q_rows = (q_begin + tok).to(tl.int64)
    qo_mask = m_valid[:, None] & d_valid[None, :]
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=qo_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    q_pos = k_len - q_len + tok  # key position of each query: it sees keys [0, q_pos]
    full_end = k_len - q_len + q_start  # keys below this are visible to every query of the tile
    kv_end = k_len - q_len + tl.minimum(q_start + BLOCK_Q, q_len)  # one past the last query's limit
    unmasked_end = (full_end // BLOCK_N) * BLOCK_N
    if SPLIT_KEYS > 0:
        # deterministic: every key tile through the masked code. The unmasked code computes the same
        # values but compiles to other arithmetic (with no select between qk's scaling and the
        # exp2's subtraction, the GPU compiler contracts them into one FMA), and whether a tile takes
        # it depends on where the launch's query tile starts: an MQA row whose 4-query tile
        # straddles a multiple of 64 keys gave its later queries other bits than decode did (SmolLM2
        # bf16 on the H200, 2026-12-04: prompt 24's output 50 with k = 8). The interpreter has no
        # FMA, so only the GPU test (tests/kernels/test_batch_invariant.py) sees it.
        unmasked_end = unmasked_end * 0
    if NUM_SPLITS == 1:
        lo, hi = 0, kv_end
    elif SPLIT_KEYS > 0:  # deterministic: the split-th fixed chunk of SPLIT_KEYS keys
        lo = split * SPLIT_KEYS
        if lo >= kv_end:  # no key for any query of the tile: the merge reads no split past a query's
            return
        hi = tl.minimum(lo + SPLIT_KEYS, kv_end)
        hi = tl.where(split == n_splits - 1, kv_end, hi)  # a max_k below the keys stays correct
    else:  # this program takes one BLOCK_N-aligned chunk of [0, kv_end)
        chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_end)
    k_ptr += kvh * stride_kh
    v_ptr += kvh * stride_vh
    bt_row_ptr = bt_ptr + row.to(tl.int64) * stride_bt

    # m starts finite so fully masked matrix rows (padding, empty splits) never compute inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, tl.minimum(hi, unmasked_end), BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            acc, m_i, l_i, q, k_ptr, v_ptr, bt_row_ptr, start, kv_end, q_pos, offs_d, d_valid,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            PAGE, BLOCK_N, False, PRECISION, UPCAST,
        )  # fmt: skip
    for start in range(tl.maximum(lo, unmasked_end), hi, BLOCK_N):
        acc, m_i, l_i = _attn_tile(
            acc, m_i, l_i, q, k_ptr, v_ptr, bt_row_ptr, start, kv_end, q_pos, offs_d, d_valid,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            PAGE, BLOCK_N, True, PRECISION, UPCAST,
        )  # fmt: skip
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=qo_mask)
    else:  # partial (m, l, acc) of this split; _combine_splits_kernel merges them
        ws = (q_rows * NUM_HEADS + head) * n_splits + split  # [T, NUM_HEADS, NUM_SPLITS] index
        tl.store(ws_ml_ptr + 2 * ws, m_i, mask=m_valid)
        tl.store(ws_ml_ptr + 2 * ws + 1, l_i, mask=m_valid)
        if SPLIT_KEYS > 0:  # a split with no keys for a query (l = 0) leaves its acc unwritten
            acc_mask = (m_valid & (l_i > 0.0))[:, None]
            if (split == 0) & (kvh == 0):  # each query's splits with keys: the merge's trip count
                nv = tl.minimum(tl.cdiv(q_pos + 1, SPLIT_KEYS), n_splits)
                tl.store(ws_nv_ptr + q_rows, nv.to(tl.int32), mask=m_valid & (offs_m % GROUP_PAD == 0))
        else:
            acc_mask = m_valid[:, None]
        tl.store(ws_acc_ptr + ws[:, None] * BLOCK_D + offs_d[None, :], acc, mask=acc_mask)


@triton.jit(**runtime_args(ints=("num_rows",), pointers=("cu_q_ptr",)))
def _combine_splits_kernel(
    o_ptr, cu_q_ptr, ws_ml_ptr, ws_acc_ptr, num_rows, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False, TRIGGER_FIRST: tl.constexpr = False,
):  # fmt: skip
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s, per (token, head)."""
    pdl_start(USE_PDL, TRIGGER_FIRST)
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t >= tl.load(cu_q_ptr + num_rows):  # padding token past the last row
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    s_valid = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    ws = (t.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS + offs_s
    m_s = tl.load(ws_ml_ptr + 2 * ws, mask=s_valid, other=-1.0e30)
    l_s = tl.load(ws_ml_ptr + 2 * ws + 1, mask=s_valid, other=0.0)
    acc = tl.load(ws_acc_ptr + ws[:, None] * BLOCK_D + offs_d[None, :], mask=s_valid[:, None], other=0.0)
    w = tl.exp2(m_s - tl.max(m_s, 0))
    out = tl.sum(acc * w[:, None], 0) / tl.maximum(tl.sum(l_s * w, 0), 1e-30)
    o_ptrs = o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit(**runtime_args(ints=("num_rows", "num_splits"), pointers=("cu_q_ptr",)))
def _combine_fixed_splits_kernel(
    o_ptr, cu_q_ptr, ws_ml_ptr, ws_acc_ptr, ws_nv_ptr, num_rows, num_splits, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Deterministic mode's merge: the same formula, summed split by split in split order over the
    token's splits with keys (``ws_nv``: a prefix of the splits); the others would add exact zeros
    (l = 0, m = -1e30), so neither ``num_splits`` nor skipping them changes the sum."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t >= tl.load(cu_q_ptr + num_rows):  # padding token past the last row
        return
    offs_d = tl.arange(0, BLOCK_D)
    base = (t.to(tl.int64) * NUM_HEADS + h) * num_splits
    nv = tl.load(ws_nv_ptr + t)
    m_max = tl.load(ws_ml_ptr + 2 * base)
    for s in range(1, nv):
        m_max = tl.maximum(m_max, tl.load(ws_ml_ptr + 2 * (base + s)))
    num = tl.zeros([BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, nv):
        m_s = tl.load(ws_ml_ptr + 2 * (base + s))
        l_s = tl.load(ws_ml_ptr + 2 * (base + s) + 1)
        w = tl.exp2(m_s - m_max)
        has_keys = offs_d < tl.where(l_s > 0.0, BLOCK_D, 0)  # [BLOCK_D]: all or none
        acc = tl.load(ws_acc_ptr + (base + s) * BLOCK_D + offs_d, mask=has_keys, other=0.0)
        num = num + acc * w
        den = den + l_s * w
    out = num / tl.maximum(den, 1e-30)
    o_ptrs = o_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit(**runtime_args(pointers=("slot_ptr",)))
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_vt, stride_ct,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    offs = tl.arange(0, BLOCK)
    mask = (offs < ROW) & ((slot + tl.zeros([BLOCK], tl.int64)) >= 0)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + offs, mask=mask)
    tl.store(kc_ptr + slot * stride_ct + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * stride_ct + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)
