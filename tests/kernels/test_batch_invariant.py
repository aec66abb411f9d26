"""Deterministic mode's kernels: a row's (a query's) result is bitwise independent of its batch.

- matmul: row i of ``batch_invariant_linear`` is bitwise the same for every M and any other rows, and
  close to the torch reference;
- attention: a query's output is bitwise the same as a decode row alone, as a batch-expansion row,
  inside an MQA row (k + 1 queries), inside a graph-padded MQA launch (more rows, a larger max_k:
  more fixed splits) and inside a prefill row.

CPU: the Triton kernels run under ``TRITON_INTERPRET=1`` in a subprocess (float32, tiny shapes); this
file is that subprocess's script when run with ``--interpreted``. The torch paths (per-row matmul,
per-query attention) run in-process. The GPU versions (bf16) are in tests/models/test_deterministic.py.
"""

from __future__ import annotations

import math
import random
import sys

import pytest
import torch

from specsched.engine.config import ModelConfig
from specsched.kernels.attention import paged_attention_torch
from specsched.kernels.batch_invariant_attention import (
    deterministic_attention_backend,
    paged_attention_per_query,
)
from specsched.kernels.batch_invariant_matmul import (
    MatmulConfig,
    batch_invariant_linear,
    linear_ref,
    linear_rows_torch,
    linear_triton,
    matmul_config,
)
from specsched.kernels.metadata import AttentionMetadata, build_metadata
from specsched.kernels.testing import interpreted_results, run_jobs
from specsched.kernels.triton_attention import (
    DETERMINISTIC_SPLIT_KEYS,
    deterministic_launch_config,
    launch_config,
    paged_attention_triton,
)
from specsched.kernels.triton_utils import is_interpreted

# --- matmul ----------------------------------------------------------------------------------------


def matmul_invariance(linear, m_values: list[int], n: int, k: int, dtype: torch.dtype, bias: bool) -> dict:
    """Rows of one fixed x placed at random positions of batches of every M (other rows random)."""
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    probe = torch.randn(min(m_values), k, generator=gen).to(dtype)  # the rows followed across batches
    want = linear(probe, w, b)
    unequal, err = 0, 0.0
    for m in m_values:
        x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
        where = torch.randperm(m, generator=gen)[: probe.shape[0]]
        x[where] = probe
        y = linear(x, w, b)
        unequal += int((y[where] != want).any(dim=1).sum())
        err = max(err, (y.float() - linear_ref(x, w, b).float()).abs().max().item())
    return {"num_unequal_rows": unequal, "max_abs_err": err}


MATMUL_CASES = {  # name: (M values, N, K, dtype, bias, tolerance vs the reference)
    # K = 80: a partial last K step; N = 96: a partial N tile; M crosses the 64-row tile
    "fp32_bias": ([3, 1, 64, 65, 130], 96, 80, "float32", True, 1e-4),
    "fp32_wide_k": ([2, 7, 70], 40, 200, "float32", False, 1e-4),
    "bf16": ([2, 5, 66], 72, 48, "bfloat16", True, 0.1),
    # K = 1100 > 1024 on a narrow N: matmul_config's fixed split-K (2 slices, the last one partial)
    "fp32_split_k": ([2, 9, 70], 40, 1100, "float32", True, 1e-3),
    "bf16_split_k": ([3, 1, 66], 48, 1100, "bfloat16", False, 0.5),
}


# --- attention -------------------------------------------------------------------------------------

SHAPE = (4, 2, 16, 16)  # heads, kv_heads, head_dim, block_size


def random_block_tables(
    totals: list[int], block_size: int, gen: torch.Generator, spare: int
) -> tuple[list[list[int]], int]:
    """Disjoint block tables in random block order for sequences of ``totals`` tokens, in a cache of
    ``spare`` more blocks than they need: (tables, number of cache blocks)."""
    need = [-(-n // block_size) for n in totals]
    perm = torch.randperm(sum(need) + spare, generator=gen).tolist()
    tables, i = [], 0
    for nb in need:
        tables.append(perm[i : i + nb])
        i += nb
    return tables, len(perm)


def attention_layouts(contexts: list[int], ks: list[int], seed: int) -> dict:
    """One set of queries (request i: k_i + 1 queries after a context of c_i keys) in every layout;
    each layout's output rows come in the same order (request by request, query by query)."""
    heads, kv_heads, dim, bs = SHAPE
    gen = torch.Generator().manual_seed(seed)
    totals = [c + k + 1 for c, k in zip(contexts, ks)]
    tables, num_blocks = random_block_tables(totals, bs, gen, spare=3)
    kc = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    vc = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    q = torch.randn(sum(ks) + len(ks), heads, dim, generator=gen)
    mqa = build_metadata([k + 1 for k in ks], totals, tables, bs)
    be_q, be_k, be_t = [], [], []
    for c, k, t in zip(contexts, ks, tables):
        be_q += [1] * (k + 1)
        be_k += [c + j + 1 for j in range(k + 1)]
        be_t += [t] * (k + 1)
    be = build_metadata(be_q, be_k, be_t, bs)
    # graph padding: 2 rows of q_len 0, 3 pad tokens, a wider table, bucket bounds
    cu, rows = mqa.cu_seqlens_q, mqa.num_rows
    width = mqa.block_tables.shape[1] + 4
    padded = AttentionMetadata(
        cu_seqlens_q=torch.cat([cu, cu[-1:].expand(2)]).contiguous(),
        seq_lens_k=torch.cat([mqa.seq_lens_k, mqa.seq_lens_k.new_zeros(2)]),
        block_tables=torch.nn.functional.pad(mqa.block_tables, (0, width - mqa.block_tables.shape[1], 0, 2)),
        slot_mapping=torch.cat([mqa.slot_mapping, mqa.slot_mapping.new_zeros(3)]),
        max_q=16,
        max_k=width * bs,
    )
    del rows
    return {"q": q, "kc": kc, "vc": vc, "tables": tables, "mqa": mqa, "be": be, "padded": padded,
            "contexts": contexts, "ks": ks, "totals": totals}  # fmt: skip


def attention_invariance(attn, contexts: list[int], ks: list[int], seed: int, alone: int = 3) -> dict:
    """``attn(q, kc, vc, meta, scale)`` in every layout; bitwise against the batch-expansion layout,
    ``alone`` queries also each as a one-row launch, the last request also as one prefill row."""
    lay = attention_layouts(contexts, ks, seed)
    q, kc, vc, scale = lay["q"], lay["kc"], lay["vc"], 1 / math.sqrt(SHAPE[2])
    n = q.shape[0]
    want = attn(q, kc, vc, lay["be"], scale)
    got = {
        "mqa": attn(q, kc, vc, lay["mqa"], scale),
        "padded": attn(torch.cat([q, torch.randn(3, *q.shape[1:])]), kc, vc, lay["padded"], scale)[:n],
    }
    # the last request as one prefill row over its whole sequence (its queries are the last k + 1)
    total, k = lay["totals"][-1], lay["ks"][-1]
    pre_q = torch.cat([torch.randn(total - k - 1, *q.shape[1:]), q[n - k - 1 :]])
    pre = attn(pre_q, kc, vc, build_metadata([total], [total], [lay["tables"][-1]], SHAPE[3]), scale)
    unequal = {name: int((o != want).flatten(1).any(1).sum()) for name, o in got.items()}
    unequal["prefill"] = int((pre[-(k + 1) :] != want[n - k - 1 :]).flatten(1).any(1).sum())
    rng, flat = random.Random(seed), []
    for c, kk, t in zip(lay["contexts"], lay["ks"], lay["tables"]):
        flat += [(c + j, t) for j in range(kk + 1)]
    picks = rng.sample(range(n), min(alone, n))
    unequal["alone"] = 0
    for i in picks:
        p, table = flat[i]
        one = attn(q[i : i + 1].clone(), kc, vc, build_metadata([1], [p + 1], [table], SHAPE[3]), scale)
        unequal["alone"] += int(not torch.equal(one[0], want[i]))
    ref = paged_attention_torch(q, kc, vc, lay["be"], scale)
    return {"unequal": unequal, "max_abs_err": (want - ref).abs().max().item()}


def triton_attn(split_keys: int):
    def attn(q, kc, vc, meta, scale):
        cfg = deterministic_launch_config(meta.max_k, SHAPE[0] // SHAPE[1], SHAPE[2], split_keys)
        return paged_attention_triton(q, kc, vc, meta, scale, config=cfg)

    return attn


# contexts cross the split points (64 here, the default 256 once) and block boundaries; k = 0..8
ATTN_CASES = {  # name: (split_keys, contexts, ks)
    "split64": (64, [0, 63, 64, 130, 200], [8, 0, 3, 1, 5]),
    "split256": (DETERMINISTIC_SPLIT_KEYS, [250, 5], [7, 2]),
}


def interpreted_main() -> None:
    jobs = {
        f"matmul_{name}": (
            lambda c=case: matmul_invariance(linear_triton, c[0], c[1], c[2], getattr(torch, c[3]), c[4])
        )
        for name, case in MATMUL_CASES.items()
    }
    jobs |= {
        f"attn_{name}": (lambda c=case: attention_invariance(triton_attn(c[0]), c[1], c[2], seed=len(c[1])))
        for name, case in ATTN_CASES.items()
    }
    run_jobs(jobs)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return interpreted_results(__file__, timeout_s=600)


@pytest.mark.parametrize("name", list(MATMUL_CASES))
def test_interpreted_matmul_rows_are_batch_invariant(interpreted: dict, name: str) -> None:
    r = interpreted[f"matmul_{name}"]
    assert "error" not in r, r.get("error")
    assert r["num_unequal_rows"] == 0, r
    assert r["max_abs_err"] < MATMUL_CASES[name][5], r


@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_interpreted_attention_query_is_launch_invariant(interpreted: dict, name: str) -> None:
    r = interpreted[f"attn_{name}"]
    assert "error" not in r, r.get("error")
    assert r["unequal"] == {"mqa": 0, "padded": 0, "prefill": 0, "alone": 0}, r
    assert r["max_abs_err"] < 1e-5, r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(9, 3, 64, 16), (32, 8, 128, 16)])
def test_gpu_mqa_query_tiles_across_key_tiles_equal_decode_bf16(shape: tuple[int, ...]) -> None:
    """Issue 16's prompt-24 failure in kernel form (bf16, the GPU's own arithmetic): MQA rows of
    k = 8 whose query tiles straddle a multiple of the 64-key tile (and of the 256-key split), each
    query bitwise equal to the same query launched alone as a decode row and to its batch-expansion
    row. Written with the fix (every deterministic tile through the masked code path: the unmasked
    path's FMA contraction gave the query after the boundary other bits) and run on the H200 only
    after it (2 passed); the model-level prompt-24 test failed before the fix and passes after."""
    heads, kv_heads, dim, bs = shape
    gen = torch.Generator().manual_seed(dim)
    k = 8
    contexts = [60, 61, 62, 63, 124, 189, 250, 252, 253, 254, 505, 1019, 3, 700]
    totals = [c + k + 1 for c in contexts]
    tables, num_blocks = random_block_tables(totals, bs, gen, spare=2)
    kc = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    vc = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    q = (torch.randn(len(contexts) * (k + 1), heads, dim, generator=gen) * 2).to("cuda", torch.bfloat16)
    scale = dim**-0.5

    def attn(qq, q_lens, k_lens, tabs):
        meta = build_metadata(q_lens, k_lens, tabs, bs, device="cuda")
        cfg = deterministic_launch_config(meta.max_k, heads // kv_heads, dim)
        return paged_attention_triton(qq, kc, vc, meta, scale, config=cfg, deterministic=True)

    mqa = attn(q, [k + 1] * len(contexts), totals, tables)
    be_k = [c + j + 1 for c in contexts for j in range(k + 1)]
    be = attn(q, [1] * len(be_k), be_k, [t for t in tables for _ in range(k + 1)])
    unequal = []
    for r, (c, t) in enumerate(zip(contexts, tables)):
        for j in range(k + 1):
            row = r * (k + 1) + j
            alone = attn(q[row : row + 1].clone(), [1], [c + j + 1], [t])
            if not (torch.equal(alone[0], mqa[row]) and torch.equal(alone[0], be[row])):
                unequal.append((c, j))
    assert unequal == []


# --- torch paths, in-process -----------------------------------------------------------------------


def test_matmul_config_splits_k_only_for_narrow_long_layers() -> None:
    bf16 = torch.bfloat16
    assert matmul_config(40, 1100, torch.float32).num_splits(1100) == 2  # the interpreted split-K case
    down = matmul_config(576, 1536, bf16)  # SmolLM2's down projection
    assert (down.block_n, down.split_k, down.k_per_split(1536), down.num_splits(1536)) == (64, 4, 384, 4)
    for n, k in [(960, 576), (3072, 576), (49152, 576)]:  # SmolLM2's K = 576 layers and LM head
        assert matmul_config(n, k, bf16).split_k == 1
    for n, k in [(4096, 11008), (12288, 4096), (22016, 4096)]:  # 7B: wide N, no split
        cfg = matmul_config(n, k, bf16)
        assert cfg.split_k == 1 and cfg.block_n >= 64
    cfg = MatmulConfig(64, 32, 64, num_warps=4, num_stages=3, split_k=8)
    assert cfg.k_per_split(100) == 64 and cfg.num_splits(100) == 2  # fewer slices than asked: no empty one
    with pytest.raises(ValueError, match="split_k"):
        MatmulConfig(64, 32, 64, num_warps=4, num_stages=3, split_k=0)
    with pytest.raises(ValueError, match="block_n"):
        MatmulConfig(64, 24, 64, num_warps=4, num_stages=3)


@pytest.mark.parametrize("bias", [True, False])
def test_torch_fallback_rows_are_batch_invariant(bias: bool) -> None:
    r = matmul_invariance(linear_rows_torch, [2, 1, 9, 40], 48, 80, torch.float32, bias)
    assert r["num_unequal_rows"] == 0 and r["max_abs_err"] < 1e-4, r


def test_public_linear_uses_the_row_fallback_on_cpu() -> None:
    if is_interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    x, w, b = torch.randn(5, 24), torch.randn(8, 24), torch.randn(8)
    assert torch.equal(batch_invariant_linear(x, w, b), linear_rows_torch(x, w, b))
    with pytest.raises(ValueError, match="x must be"):
        batch_invariant_linear(x, w[:, :5])
    with pytest.raises(ValueError, match="share one of"):
        batch_invariant_linear(x, w.double())


def test_per_query_attention_is_launch_invariant() -> None:
    r = attention_invariance(paged_attention_per_query, [0, 3, 40, 70, 17], [8, 0, 4, 1, 6], seed=5, alone=6)
    assert r["unequal"] == {"mqa": 0, "padded": 0, "prefill": 0, "alone": 0}, r
    assert r["max_abs_err"] < 1e-5, r


def test_deterministic_config_ignores_rows_queries_and_sms() -> None:
    base = deterministic_launch_config(1, 3, 64)
    for max_q, rows, sms in [(1, 1, 132), (9, 64, 132), (2048, 1, 78), (4, 576, 16)]:
        cfg = launch_config(max_q, 100, rows, 3, 3, 64, num_sms=sms, deterministic=True)
        assert cfg == base
    assert base.is_deterministic and base.num_splits == 1 and base.block_m == 16
    keys = DETERMINISTIC_SPLIT_KEYS
    assert launch_config(1, keys, 1, 3, 3, 64, deterministic=True).num_splits == 1
    assert launch_config(1, keys + 1, 1, 3, 3, 64, deterministic=True).num_splits == 2
    assert launch_config(1, 4096, 1, 3, 3, 64, deterministic=True).num_splits == 4096 // keys
    assert not launch_config(1, 4096, 1, 3, 3, 64).is_deterministic  # the default path is unchanged


def test_deterministic_backends_and_config_validation() -> None:
    assert deterministic_attention_backend("torch") is paged_attention_per_query
    with pytest.raises(ValueError, match="no deterministic mode"):
        deterministic_attention_backend("flash_attn")
    with pytest.raises(ValueError, match="attn_backend"):
        ModelConfig(deterministic=True, attn_backend="flash_attn")
    with pytest.raises(ValueError, match="true or false"):
        ModelConfig(deterministic="yes")  # type: ignore[arg-type]
    q = torch.zeros(1, 4, 16)
    kc = torch.zeros(2, 16, 2, 16)
    meta = build_metadata([1], [1], [[1]], 16)
    cfg = launch_config(1, 1, 1, 2, 2, 16)
    with pytest.raises(ValueError, match="deterministic config"):
        paged_attention_triton(q, kc, kc, meta, 0.25, config=cfg, deterministic=True)


if __name__ == "__main__" and sys.argv[1:] == ["--interpreted"]:
    interpreted_main()
