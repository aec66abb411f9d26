"""Triton paged varlen attention vs the torch reference.

CPU: the kernel runs under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set before
triton is imported, and other test files import triton first); this file is that subprocess's
script when run with ``--interpreted``. GPU (marked ``gpu``): real shapes in bf16 and CUDA-graph
capture/replay with new metadata contents.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import triton
import triton.language as tl

from specsched.kernels.attention import paged_attention_torch, store_kv
from specsched.kernels.metadata import AttentionMetadata, build_metadata
from specsched.kernels.testing import interpreted_results, run_jobs
from specsched.kernels.triton_attention import (
    LaunchConfig,
    is_interpreted,
    launch_config,
    paged_attention_triton,
    store_kv_triton,
)


def make_inputs(
    q_lens: list[int],
    k_lens: list[int],
    shape: tuple[int, int, int, int],  # (num_heads, kv_heads, head_dim, block_size)
    dtype: torch.dtype,
    *,
    device: str = "cpu",
    spare_blocks: int = 3,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and caches; each row's blocks drawn from one permutation, spare blocks hold junk."""
    num_heads, kv_heads, head_dim, block_size = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    need = [-(-k // block_size) for k in k_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i : i + n])
        i += n
    meta = build_metadata(q_lens, k_lens, tables, block_size, device)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device).to(dtype)

    q = rand(sum(q_lens), num_heads, head_dim)
    k_cache = rand(num_blocks, block_size, kv_heads, head_dim)
    v_cache = rand(num_blocks, block_size, kv_heads, head_dim)
    return q, k_cache, v_cache, meta


def pad_meta(
    meta: AttentionMetadata, *, rows: int, tokens: int, width: int, max_q: int, max_k: int
) -> AttentionMetadata:
    """Graph-style padding: extra rows with q_len 0, extra tokens, wider block table, upper bounds."""
    extra_rows, extra_tokens = rows - meta.num_rows, tokens - meta.num_tokens
    cu = meta.cu_seqlens_q
    bt = meta.block_tables
    return AttentionMetadata(
        cu_seqlens_q=torch.cat([cu, cu[-1:].expand(extra_rows)]).contiguous(),
        seq_lens_k=torch.cat([meta.seq_lens_k, meta.seq_lens_k.new_zeros(extra_rows)]),
        block_tables=torch.nn.functional.pad(bt, (0, width - bt.shape[1], 0, extra_rows)),
        slot_mapping=torch.cat([meta.slot_mapping, meta.slot_mapping.new_zeros(extra_tokens)]),
        max_q=max_q,
        max_k=max_k,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# Interpreted cases: tiny shapes. Query lengths mix 0 (padding), 1 (decode), k+1 (MQA) and a long
# prefill row; key counts cross block boundaries.
# name: (q_lens, k_lens, (heads, kv_heads, head_dim, block_size), dtype, rel tol, launch overrides)
CASES: dict[str, tuple] = {
    "gqa_fp32_d16": ([0, 1, 4, 37, 1, 3], [5, 17, 33, 70, 1, 3], (4, 2, 16, 16), "float32", 1e-5, {}),
    "mha_fp32_d64": ([1, 4, 1, 20], [16, 32, 49, 20], (2, 2, 64, 16), "float32", 1e-5, {}),
    "gqa_group3_fp16": ([2, 0, 6, 1], [40, 9, 6, 65], (6, 2, 16, 16), "float16", 3e-3, {}),
    "mqa_bf16_bs32": ([4, 1, 19], [70, 33, 19], (4, 1, 32, 32), "bfloat16", 1e-2, {}),
    "page64_tile16": ([3, 1, 24], [130, 64, 80], (2, 1, 16, 64), "float32", 1e-5, {"block_n": 16}),
    "head_dim24_padded": ([5, 1], [21, 40], (2, 2, 24, 16), "float32", 1e-5, {}),
    # Split-KV: more splits than some rows have tiles (empty splits), causal tile inside a split.
    "split3_gqa": ([1, 4, 0, 1, 20], [100, 37, 8, 2, 90], (4, 2, 16, 16), "float32", 1e-5,
                   {"num_splits": 3, "block_n": 16}),
    "split5_bf16": ([1, 6], [150, 70], (4, 4, 32, 16), "bfloat16", 1e-2, {"num_splits": 5, "block_n": 16}),
}  # fmt: skip


def config_for(meta: AttentionMetadata, shape: tuple, overrides: dict) -> LaunchConfig | None:
    heads, kv_heads, head_dim, _ = shape
    if not overrides:
        return None
    return launch_config(
        meta.max_q, meta.max_k, meta.num_rows, heads // kv_heads, kv_heads, head_dim, **overrides
    )


def run_case(q_lens, k_lens, shape, dtype, tol, overrides) -> dict:
    q, kc, vc, meta = make_inputs(q_lens, k_lens, shape, getattr(torch, dtype))
    scale = 1.0 / math.sqrt(shape[2])
    ref = paged_attention_torch(q.float(), kc.float(), vc.float(), meta, scale)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kc, vc, meta, scale, out=out, config=config_for(meta, shape, overrides))
    return {"rel_err": rel_err(out, ref), "num_nan": int(out.isnan().sum())}


def run_padded_case(num_splits: int) -> dict:
    """Metadata padded as for a captured graph; the pad tokens must stay untouched (NaN)."""
    q_lens, k_lens = [1, 4, 2], [20, 36, 2]
    q, kc, vc, meta = make_inputs(q_lens, k_lens, (4, 2, 16, 16), torch.float32)
    scale = 0.25
    ref = paged_attention_torch(q, kc, vc, meta, scale)
    padded = pad_meta(meta, rows=6, tokens=meta.num_tokens + 5, width=5, max_q=16, max_k=80)
    q_pad = torch.cat([q, torch.randn(5, 4, 16)])
    out = torch.full_like(q_pad, float("nan"))
    cfg = config_for(padded, (4, 2, 16, 16), {"num_splits": num_splits, "block_n": 16})
    paged_attention_triton(q_pad, kc, vc, padded, scale, out=out, config=cfg)
    n = meta.num_tokens
    return {
        "rel_err": rel_err(out[:n], ref),
        "num_nan": int(out[:n].isnan().sum()),
        "pad_untouched": bool(out[n:].isnan().all()),
    }


def run_strided_q_case() -> dict:
    """q and out as column slices of fused qkv-like buffers (token stride != heads * head_dim)."""
    q_lens, k_lens = [3, 1, 9], [3, 30, 40]
    _, kc, vc, meta = make_inputs(q_lens, k_lens, (4, 2, 16, 16), torch.float32)
    qkv = torch.randn(meta.num_tokens, 8, 16)
    q = qkv[:, :4]
    out_buf = torch.full((meta.num_tokens, 6, 16), float("nan"))
    out = out_buf[:, 1:5]
    paged_attention_triton(q, kc, vc, meta, 0.25, out=out)
    ref = paged_attention_torch(q.contiguous(), kc, vc, meta, 0.25)
    return {
        "rel_err": rel_err(out, ref),
        "num_nan": int(out.isnan().sum()),
        "pad_untouched": bool(out_buf[:, 0].isnan().all() and out_buf[:, 5].isnan().all()),
    }


def run_store_kv_case() -> dict:
    torch.manual_seed(0)
    kc, vc = torch.randn(6, 16, 2, 16), torch.randn(6, 16, 2, 16)
    k, v = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    slots = torch.tensor([5, 17, -1, 40, 41, 95, -1], dtype=torch.int64)
    kept = slots >= 0
    exp_k, exp_v = kc.clone(), vc.clone()
    store_kv(k[kept], v[kept], exp_k, exp_v, slots[kept])
    store_kv_triton(k, v, kc, vc, slots)
    return {"k_equal": bool(torch.equal(kc, exp_k)), "v_equal": bool(torch.equal(vc, exp_v))}


@triton.jit
def _loop_bound_probe(n_ptr, out_ptr):
    acc = 0
    for _ in range(0, tl.load(n_ptr), 2):
        acc += 1
    tl.store(out_ptr, acc)


def interpreter_defect() -> str | None:
    """Some Triton interpreters (3.6 with numpy 2.4) cannot take a loaded value as a loop bound."""
    out = torch.zeros(1, dtype=torch.int32)
    try:
        _loop_bound_probe[(1,)](torch.tensor([5], dtype=torch.int32), out)
    except Exception as e:
        return f"triton {triton.__version__} interpreter cannot run data-dependent loops here: {e!r}"
    return None if out.item() == 3 else f"triton {triton.__version__} interpreter miscounts a loop"


def interpreted_main() -> None:
    if (defect := interpreter_defect()) is not None:
        run_jobs({}, header={"_defect": {"reason": defect}})
        return
    jobs = {name: (lambda c=case: run_case(*c)) for name, case in CASES.items()}
    jobs |= {
        "padded": lambda: run_padded_case(num_splits=1),
        "padded_split": lambda: run_padded_case(num_splits=4),
        "strided_q": run_strided_q_case,
        "store_kv": run_store_kv_case,
    }
    run_jobs(jobs)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    results = interpreted_results(__file__, timeout_s=600)
    if "_defect" in results:
        pytest.skip(results["_defect"]["reason"])
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_reference(interpreted: dict, name: str) -> None:
    r = interpreted[name]
    assert "error" not in r, r.get("error")
    assert r["num_nan"] == 0, f"{r['num_nan']} output elements unwritten or NaN"
    assert r["rel_err"] < CASES[name][4], r


@pytest.mark.parametrize("name", ["padded", "padded_split", "strided_q"])
def test_interpreted_padding_untouched(interpreted: dict, name: str) -> None:
    r = interpreted[name]
    assert "error" not in r, r.get("error")
    assert r["num_nan"] == 0 and r["rel_err"] < 1e-5, r
    assert r["pad_untouched"], "the kernel wrote outside the rows' tokens"


def test_interpreted_store_kv(interpreted: dict) -> None:
    r = interpreted["store_kv"]
    assert "error" not in r, r.get("error")
    assert r["k_equal"] and r["v_equal"]


@pytest.mark.parametrize("max_q", [1, 4, 33, 512])
@pytest.mark.parametrize("group", [1, 3, 4, 8, 32])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_launch_config_tiles_fit_tl_dot(max_q: int, group: int, head_dim: int) -> None:
    cfg = launch_config(max_q, 2048, 8, group, 4, head_dim)
    assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.block_d >= max(16, head_dim)
    assert cfg.group_pad >= group and cfg.group_pad & (cfg.group_pad - 1) == 0
    assert cfg.block_q >= 1 and cfg.block_q & (cfg.block_q - 1) == 0
    assert cfg.block_m <= max(64, cfg.group_pad)  # bounded register tile


def test_launch_config_splits_only_small_grids_with_long_rows() -> None:
    # batch 1 decode, 32 KV heads, 2048 keys: 32 programs on 132 SMs -> split
    assert launch_config(1, 2048, 1, 1, 32, 128, num_sms=132).num_splits > 1
    # short rows: no split however small the grid
    assert launch_config(1, 100, 1, 1, 32, 128, num_sms=132).num_splits == 1
    # a grid that already fills the GPU: no split
    assert launch_config(4, 2048, 64, 1, 32, 128, num_sms=132).num_splits == 1
    # explicit values win
    assert launch_config(1, 2048, 1, 1, 32, 128, num_splits=7).num_splits == 7


def test_launch_config_rejects_bad_block_n() -> None:
    with pytest.raises(ValueError, match="block_n"):
        launch_config(4, 64, 1, 1, 1, 64, block_n=24)


def _small(dtype: torch.dtype = torch.float32):
    return make_inputs([1, 3], [5, 20], (2, 1, 16, 16), dtype)


def test_rejects_non_int32_metadata() -> None:
    q, kc, vc, meta = _small()
    meta.cu_seqlens_q = meta.cu_seqlens_q.long()
    with pytest.raises(ValueError, match="cu_seqlens_q must be int32"):
        paged_attention_triton(q, kc, vc, meta, 0.25)


def test_rejects_bad_shapes_and_dtypes() -> None:
    q, kc, vc, meta = _small()
    bad = AttentionMetadata(
        meta.cu_seqlens_q[:-1], meta.seq_lens_k, meta.block_tables, meta.slot_mapping, meta.max_q, meta.max_k
    )
    with pytest.raises(ValueError, match="cu_seqlens_q must be"):
        paged_attention_triton(q, kc, vc, bad, 0.25)
    with pytest.raises(ValueError, match="out must be"):
        paged_attention_triton(q, kc, vc, meta, 0.25, out=torch.empty(3, 2, 16))
    with pytest.raises(ValueError, match="not supported"):
        paged_attention_triton(q.double(), kc.double(), vc.double(), meta, 0.25)
    with pytest.raises(ValueError, match="head_dim differs"):
        paged_attention_triton(q[..., :8], kc, vc, meta, 0.25)
    with pytest.raises(ValueError, match="stride"):
        paged_attention_triton(q.transpose(0, 2).contiguous().transpose(0, 2), kc, vc, meta, 0.25)


def test_cpu_tensors_need_cuda_or_interpreter() -> None:
    if is_interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    q, kc, vc, meta = _small()
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        paged_attention_triton(q, kc, vc, meta, 0.25)


def test_store_kv_triton_rejects_bad_args() -> None:
    kc = torch.zeros(4, 16, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_triton(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), kc, kc.clone(), torch.zeros(3).int())
    with pytest.raises(ValueError, match="k/v must"):
        store_kv_triton(torch.zeros(3, 1, 16), torch.zeros(3, 1, 16), kc, kc.clone(), torch.zeros(3).long())


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _real_batch(seed: int) -> tuple[list[int], list[int]]:
    """64 rows: decode, k+1 (k = 3, 5), two prefill chunks; contexts up to 2048."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = [[1, 4, 6, 1][i % 4] for i in range(62)] + [300, 129]
    k_lens = [int(torch.randint(q, 2049, (1,), generator=gen)) for q in q_lens]
    k_lens[0], k_lens[-1] = 2048, 2048
    return q_lens, k_lens


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_heads", [32, 8])
def test_gpu_real_shapes_bf16(kv_heads: int) -> None:
    q_lens, k_lens = _real_batch(seed=kv_heads)
    q, kc, vc, meta = make_inputs(
        q_lens, k_lens, (32, kv_heads, 128, 16), torch.bfloat16, device="cuda", spare_blocks=64
    )
    scale = 128**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kc, vc, meta, scale, out=out)
    ref = paged_attention_torch(q.float(), kc.float(), vc.float(), meta, scale)
    assert not out.isnan().any(), "unwritten output elements"
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "tol"),
    [(torch.float16, 64, 32, 5e-3), (torch.float32, 128, 16, 1e-4), (torch.bfloat16, 64, 64, 1e-2)],
)
def test_gpu_dtypes(dtype: torch.dtype, head_dim: int, block_size: int, tol: float) -> None:
    q_lens, k_lens = [0, 1, 4, 1, 77, 6], [10, 300, 517, 1, 200, 6]
    q, kc, vc, meta = make_inputs(q_lens, k_lens, (8, 2, head_dim, block_size), dtype, device="cuda")
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, kc, vc, meta, head_dim**-0.5, out=out)
    ref = paged_attention_torch(q.float(), kc.float(), vc.float(), meta, head_dim**-0.5)
    assert not out.isnan().any()
    assert rel_err(out, ref) < tol


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay_with_new_metadata() -> None:
    """Capture once; replay after copying other metadata contents (same shapes) into the buffers."""
    q_a, k_a = [4, 1, 1, 4, 2, 0, 3, 1], [700, 33, 1, 4, 90, 17, 2048, 160]
    q_b, k_b = [1, 4, 4, 0, 1, 2, 1, 3], [2000, 5, 300, 64, 1, 2, 999, 1500]
    heads, kv_heads, dim, bs = 32, 8, 128, 16
    qa, kc, vc, meta_a = make_inputs(
        q_a, k_a, (heads, kv_heads, dim, bs), torch.bfloat16, device="cuda", seed=1, spare_blocks=200
    )

    # Later batches take their tables from other permutations of the same cache.
    def batch(q_lens: list[int], k_lens: list[int], seed: int) -> AttentionMetadata:
        perm = torch.randperm(kc.shape[0], generator=torch.Generator().manual_seed(seed)).tolist()
        tables, i = [], 0
        for k in k_lens:
            tables.append(perm[i : i + -(-k // bs)])
            i += -(-k // bs)
        return build_metadata(q_lens, k_lens, tables, bs, "cuda")

    meta_b = batch(q_b, k_b, seed=2)
    meta_c = batch([1, 1, 4, 1, 1, 1], [2048, 1, 4, 77, 1000, 16], seed=3)  # 6 rows, 9 tokens: padded
    width, scale = 128, dim**-0.5
    static = pad_meta(meta_a, rows=8, tokens=16, width=width, max_q=4, max_k=2048)
    q_static, out_static = qa.clone(), torch.full_like(qa, float("nan"))
    paged_attention_triton(q_static, kc, vc, static, scale, out=out_static)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_triton(q_static, kc, vc, static, scale, out=out_static)

    for meta in (meta_a, meta_b, meta_c, meta_a):
        padded = pad_meta(meta, rows=8, tokens=16, width=width, max_q=4, max_k=2048)
        for name in ("cu_seqlens_q", "seq_lens_k", "block_tables", "slot_mapping"):
            getattr(static, name).copy_(getattr(padded, name))
        q_static.copy_(torch.randn_like(q_static))
        out_static.fill_(float("nan"))
        graph.replay()
        n = meta.num_tokens
        ref = paged_attention_torch(q_static[:n].float(), kc.float(), vc.float(), meta, scale)
        assert not out_static[:n].isnan().any()
        assert out_static[n:].isnan().all(), "padding tokens were written"
        assert rel_err(out_static[:n], ref) < 1e-2


@pytest.mark.gpu
@gpu
def test_gpu_store_kv_triton_matches_store_kv() -> None:
    kc = torch.randn(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    k, v = torch.randn(40, 8, 128, device="cuda"), torch.randn(40, 8, 128, device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:40]
    exp_k, exp_v = kc.clone(), vc.clone()
    store_kv(k, v, exp_k, exp_v, slots)
    store_kv_triton(k, v, kc, vc, slots)
    assert torch.equal(kc, exp_k) and torch.equal(vc, exp_v)


if __name__ == "__main__" and sys.argv[1:] == ["--interpreted"]:
    interpreted_main()


def test_unsplit_launches_share_one_set_of_placeholder_workspaces() -> None:
    """An unsplit launch never touches the split workspaces: one cached set per device, not three
    allocations a launch (the interpreted tests above run unsplit launches with them)."""
    from specsched.kernels.triton_attention import _unused_workspaces

    a, b = _unused_workspaces(torch.device("cpu")), _unused_workspaces(torch.device("cpu"))
    assert all(x is y for x, y in zip(a, b, strict=True))
    assert [t.dtype for t in a] == [torch.float32, torch.float32, torch.int32]
