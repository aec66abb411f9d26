"""The torch reference (``paged_attention_torch``, ``store_kv``, ``build_metadata``) against a naive
per-token attention over dense per-row K/V written into a randomly permuted paged cache."""

from __future__ import annotations

import math

import pytest
import torch

from specsched.kernels.attention import paged_attention_torch, store_kv
from specsched.kernels.metadata import build_metadata


def naive_attention(
    q: torch.Tensor,  # [q_len, num_heads, D]
    keys: torch.Tensor,  # [k_len, kv_heads, D]
    vals: torch.Tensor,  # [k_len, kv_heads, D]
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, D]
    """Query j sits at key position k_len - q_len + j and sees keys 0..that position."""
    q_len, num_heads, _ = q.shape
    k_len, kv_heads, _ = keys.shape
    out = torch.zeros_like(q)
    for j in range(q_len):
        pos = k_len - q_len + j
        for h in range(num_heads):
            kvh = h // (num_heads // kv_heads)
            scores = [float(q[j, h] @ keys[t, kvh]) * scale for t in range(pos + 1)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for t, w in enumerate(weights):
                out[j, h] += (w / total) * vals[t, kvh]
    return out


def random_tables(k_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator) -> list:
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for k in k_lens:
        n = -(-k // block_size)
        tables.append(perm[i : i + n])
        i += n
    return tables


def scatter(cache: torch.Tensor, dense: torch.Tensor, table: list[int], upto: int) -> None:
    """Write dense[p] into the slot of key position p, for p < upto, one position at a time."""
    bs = cache.shape[1]
    for p in range(upto):
        cache[table[p // bs], p % bs] = dense[p]


@pytest.mark.parametrize(("num_heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_matches_naive(num_heads: int, kv_heads: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(num_heads * 100 + kv_heads * 10 + block_size)
    q_lens, k_lens, dim = [0, 1, 4, 9, 1, 3], [3, 1, 13, 9, 30, 21], 8
    num_blocks = sum(-(-k // block_size) for k in k_lens) + 2
    tables = random_tables(k_lens, block_size, num_blocks, gen)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen, dtype=torch.float64)
    dense_k = [torch.randn(k, kv_heads, dim, generator=gen, dtype=torch.float64) for k in k_lens]
    dense_v = [torch.randn(k, kv_heads, dim, generator=gen, dtype=torch.float64) for k in k_lens]
    for table, dk, dv, k in zip(tables, dense_k, dense_v, k_lens, strict=True):
        scatter(k_cache, dk, table, k)
        scatter(v_cache, dv, table, k)
    meta = build_metadata(q_lens, k_lens, tables, block_size)
    q = torch.randn(sum(q_lens), num_heads, dim, generator=gen, dtype=torch.float64)
    scale = 0.3

    out = paged_attention_torch(q, k_cache, v_cache, meta, scale)
    start = 0
    for n_q, dk, dv in zip(q_lens, dense_k, dense_v, strict=True):
        expected = naive_attention(q[start : start + n_q], dk, dv, scale)
        torch.testing.assert_close(out[start : start + n_q], expected, rtol=1e-9, atol=1e-9)
        start += n_q


def test_store_kv_writes_new_tokens_into_their_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    q_lens, k_lens, bs, heads, dim = [2, 0, 5, 1], [7, 4, 5, 18], 4, 2, 8
    num_blocks = sum(-(-k // bs) for k in k_lens) + 3
    tables = random_tables(k_lens, bs, num_blocks, gen)
    dense = [torch.randn(k, heads, dim, generator=gen) for k in k_lens]
    junk = torch.randn(num_blocks, bs, heads, dim, generator=gen)
    k_cache, v_cache, expected_k, expected_v = (junk.clone() for _ in range(4))
    for table, d, k, q in zip(tables, dense, k_lens, q_lens, strict=True):
        scatter(k_cache, d, table, k - q)  # cached prefix only
        scatter(v_cache, -d, table, k - q)
        scatter(expected_k, d, table, k)  # prefix and new tokens
        scatter(expected_v, -d, table, k)
    new = torch.cat([d[k - q :] for d, k, q in zip(dense, k_lens, q_lens, strict=True)])
    meta = build_metadata(q_lens, k_lens, tables, bs)
    store_kv(new, -new, k_cache, v_cache, meta.slot_mapping)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)


def test_store_kv_casts_to_cache_dtype() -> None:
    k_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(1, 1, 8)
    store_kv(k, k, k_cache, v_cache, torch.tensor([6]))
    torch.testing.assert_close(k_cache[1, 2], k[0].to(torch.bfloat16), rtol=0, atol=0)
    assert k_cache.sum() == k_cache[1, 2].sum()


def test_build_metadata_layout() -> None:
    # Row 0: keys 0..4, new tokens at positions 3, 4 -> block 3 slot 3 (15), block 1 slot 0 (4).
    # Row 1: no new tokens. Row 2: one key, new at position 0 -> block 2 slot 0 (8).
    meta = build_metadata([2, 0, 1], [5, 3, 1], [[3, 1], [0], [2]], block_size=4)
    assert meta.cu_seqlens_q.tolist() == [0, 2, 2, 3]
    assert meta.seq_lens_k.tolist() == [5, 3, 1]
    assert meta.block_tables.tolist() == [[3, 1], [0, 0], [2, 0]]
    assert meta.slot_mapping.tolist() == [15, 4, 8]
    assert (meta.max_q, meta.max_k, meta.num_rows, meta.num_tokens) == (2, 5, 3, 3)
    assert meta.cu_seqlens_q.dtype == meta.seq_lens_k.dtype == meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64


def test_build_metadata_empty_batch() -> None:
    meta = build_metadata([], [], [], block_size=16)
    assert meta.num_rows == 0 and meta.num_tokens == 0 and meta.max_q == 0
    out = paged_attention_torch(
        torch.zeros(0, 2, 8), torch.zeros(1, 16, 2, 8), torch.zeros(1, 16, 2, 8), meta, 1.0
    )
    assert out.shape == (0, 2, 8)


@pytest.mark.parametrize(
    ("q_lens", "k_lens", "tables", "match"),
    [
        ([1, 2], [3], [[0]], "differ in length"),
        ([4], [3], [[0]], "0 <= q_len <= k_len"),
        ([-1], [3], [[0]], "0 <= q_len <= k_len"),
        ([1], [9], [[0, 1]], "needs 3 blocks, has 2"),
    ],
)
def test_build_metadata_rejects_bad_rows(q_lens, k_lens, tables, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_metadata(q_lens, k_lens, tables, block_size=4)


def test_reference_rejects_bad_args() -> None:
    meta = build_metadata([2], [5], [[0, 1]], block_size=4)
    q, kc = torch.zeros(2, 4, 8), torch.zeros(2, 4, 2, 8)
    cases = [
        (q[0], kc, kc, "q must be"),
        (q, kc, kc[:1], "k_cache/v_cache must both be"),
        (q[..., :4], kc, kc, "head_dim differs"),
        (q[:, :3], kc, kc, "not a multiple of kv_heads"),
        (q.double(), kc, kc, "dtype differs"),
        (q[:1], kc, kc, "q has 1 tokens, metadata 2"),
    ]
    for q_bad, k_bad, v_bad, match in cases:
        with pytest.raises(ValueError, match=match):
            paged_attention_torch(q_bad, k_bad, v_bad, meta, 1.0)
