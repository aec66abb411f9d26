"""Fused rotary + KV store: Triton kernel vs the torch reference, reference vs the HF rotate-half formula.

CPU: the kernel runs under ``TRITON_INTERPRET=1`` in a subprocess (see test_triton_attention.py for
why); this file is that subprocess's script when run with ``--interpreted``. Caches are poisoned with
NaN first, so slots the kernel must not write stay NaN and unwritten slots show up. GPU (marked
``gpu``): real shapes in bf16 and CUDA-graph replay.
"""

from __future__ import annotations

import sys

import pytest
import torch

from specsched.kernels.rotary import rotary_store_kv, rotary_store_kv_ref, rotary_store_kv_triton
from specsched.kernels.testing import interpreted_results, run_jobs
from specsched.kernels.triton_utils import diff_stats, is_interpreted

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def hf_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama's formula (models/llama.py apply_rope), written out independently: x [T, H, D]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def make_inputs(
    num_tokens: int,
    heads: tuple[int, int, int],  # (num_heads, num_kv_heads, head_dim)
    dtype: torch.dtype,
    *,
    num_blocks: int = 6,
    block_size: int = 4,
    seed: int = 0,
    device: str = "cpu",
    row_stride: int = 0,
) -> dict:
    """qkv (optionally a column slice of a wider buffer), cos/sin from positions as the model computes
    them, NaN-poisoned caches and distinct slots drawn at random (block 0, the pad block, excluded)."""
    hq, hkv, d = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(num_tokens, max(width, row_stride), generator=gen, device=device).to(dtype)[:, :width]
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen, device=device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)).float()
    freqs = positions.float()[:, None] * inv_freq[None, :]
    perm = torch.randperm((num_blocks - 1) * block_size, generator=gen, device=device) + block_size
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    return {
        "qkv": qkv,
        "cos": freqs.cos(),
        "sin": freqs.sin(),
        "k_cache": k_cache,
        "v_cache": k_cache.clone(),
        "slot_mapping": perm[:num_tokens].contiguous(),
        "num_heads": hq,
        "num_kv_heads": hkv,
    }


def clone_caches(inp: dict) -> dict:
    return {**inp, "k_cache": inp["k_cache"].clone(), "v_cache": inp["v_cache"].clone()}


def compare(inp: dict, ref_inp: dict, q: torch.Tensor, ref_q: torch.Tensor) -> dict:
    """Stats of q and both caches (NaN positions must agree: untouched slots stay NaN)."""
    return {
        "q": diff_stats(q, ref_q),
        "k_cache": diff_stats(inp["k_cache"], ref_inp["k_cache"]),
        "v_cache": diff_stats(inp["v_cache"], ref_inp["v_cache"]),
        "num_written": int((~inp["k_cache"].isnan()).any(-1).any(-1).sum()),
    }


# name: (num_tokens, (num_heads, num_kv_heads, head_dim), dtype, row stride of qkv (0 = contiguous))
CASES: dict[str, tuple] = {
    "t1_mha_d16_bf16": (1, (4, 4, 16), "bfloat16", 0),
    "t5_gqa_d64_bf16": (5, (8, 2, 64), "bfloat16", 0),
    "t3_group3_d24_fp16": (3, (6, 2, 24), "float16", 0),
    "t4_mqa_d128_fp32": (4, (4, 1, 128), "float32", 0),
    "t6_gqa_d256_bf16": (6, (2, 1, 256), "bfloat16", 0),
    "t2_head_blocks_d256_bf16": (2, (20, 10, 256), "bfloat16", 0),  # 2 q head blocks, 2 v chunks
    "strided_qkv_bf16": (4, (4, 2, 32), "bfloat16", 300),
}


def run_case(num_tokens: int, heads: tuple, dtype: str, row_stride: int) -> dict:
    inp = make_inputs(num_tokens, tuple(heads), DTYPES[dtype], seed=num_tokens, row_stride=row_stride)
    ref_inp = clone_caches(inp)
    qkv_before = inp["qkv"].clone()
    q = rotary_store_kv_triton(**inp)
    ref_q = rotary_store_kv_ref(**ref_inp)
    buf = torch.full((num_tokens + 2, *q.shape[1:]), 7.0, dtype=q.dtype)  # a static buffer, longer
    q_buf = rotary_store_kv_triton(**clone_caches(inp), q_out=buf[:num_tokens])
    q_out_ok = q_buf.data_ptr() == buf.data_ptr() and torch.equal(q_buf, q)
    q_out_ok = q_out_ok and bool((buf[num_tokens:] == 7).all())
    return {**compare(inp, ref_inp, q, ref_q), "qkv_unchanged": bool(torch.equal(inp["qkv"], qkv_before)),
            "q_out_ok": q_out_ok}  # fmt: skip


def run_graph_padding_case() -> dict:
    """Graph padding: 3 real tokens, then 2 pad tokens whose slots are PAD_SLOT (0, in block 0)."""
    inp = make_inputs(5, (4, 2, 16), torch.bfloat16, seed=7)
    inp["slot_mapping"][3:] = 0
    real = {**clone_caches(inp), "qkv": inp["qkv"][:3], "cos": inp["cos"][:3], "sin": inp["sin"][:3],
            "slot_mapping": inp["slot_mapping"][:3]}  # fmt: skip
    q = rotary_store_kv_triton(**inp)
    ref_q = rotary_store_kv_ref(**real)
    # slot 0 holds one of the pad tokens' K/V (which one is unspecified, as for index_copy_); cleared
    # before comparing, so every other element must match the real tokens' reference
    k0, v0 = inp["k_cache"][0, 0].clone(), inp["v_cache"][0, 0].clone()
    inp["k_cache"][0, 0], inp["v_cache"][0, 0] = float("nan"), float("nan")
    stats = compare(inp, real, q[:3], ref_q)
    one_pad = []
    for t in (3, 4):
        only = {**clone_caches(inp), "qkv": inp["qkv"][t : t + 1], "cos": inp["cos"][t : t + 1],
                "sin": inp["sin"][t : t + 1], "slot_mapping": inp["slot_mapping"][t : t + 1]}  # fmt: skip
        rotary_store_kv_ref(**only)
        one_pad.append(torch.equal(only["k_cache"][0, 0], k0) and torch.equal(only["v_cache"][0, 0], v0))
    return {**stats, "pad_slot_holds_a_pad_token": any(one_pad)}


def run_negative_slot_case() -> dict:
    """Triton-only guard: a negative slot writes nothing (its q is still rotated)."""
    inp = make_inputs(4, (4, 2, 16), torch.float16, seed=3)
    inp["slot_mapping"][1] = -1
    keep = torch.tensor([0, 2, 3])
    ref_inp = {**clone_caches(inp), "qkv": inp["qkv"][keep], "cos": inp["cos"][keep], "sin": inp["sin"][keep],
               "slot_mapping": inp["slot_mapping"][keep]}  # fmt: skip
    q = rotary_store_kv_triton(**inp)
    ref_q = rotary_store_kv_ref(**ref_inp)
    q_all = hf_rotate_half(inp["qkv"][:, :64].reshape(4, 4, 16), inp["cos"], inp["sin"])
    return {**compare(inp, ref_inp, q[keep], ref_q), "q_all_equal": bool(torch.equal(q, q_all))}


def interpreted_main() -> None:
    jobs = {name: (lambda c=case: run_case(*c)) for name, case in CASES.items()}
    jobs |= {"graph_padding": run_graph_padding_case, "negative_slot": run_negative_slot_case}
    run_jobs(jobs)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return interpreted_results(__file__)


def assert_bit_equal(r: dict, num_tokens: int) -> None:
    assert "error" not in r, r.get("error")
    for key in ("q", "k_cache", "v_cache"):
        assert r[key]["num_diff"] == 0, f"{key}: {r[key]}"
    assert r["num_written"] == num_tokens, f"{r['num_written']} slots written, expected {num_tokens}"


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_reference_bit_exact(interpreted: dict, name: str) -> None:
    r = interpreted[name]
    print(name, {k: r[k] for k in ("q", "k_cache", "v_cache")} if "q" in r else r)
    assert_bit_equal(r, CASES[name][0])
    assert r["qkv_unchanged"], "the kernel wrote into qkv"
    assert r["q_out_ok"], "q_out: the same rotated q, written into the given rows only"


def test_interpreted_graph_padding_writes_only_pad_slot(interpreted: dict) -> None:
    r = interpreted["graph_padding"]
    assert_bit_equal(r, 3)
    assert r["pad_slot_holds_a_pad_token"]


def test_interpreted_negative_slot_skipped(interpreted: dict) -> None:
    r = interpreted["negative_slot"]
    assert_bit_equal(r, 3)
    assert r["q_all_equal"]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("heads", [(4, 4, 16), (8, 2, 64), (6, 2, 24)])
def test_reference_matches_hf_formula_and_store_kv(dtype: str, heads: tuple) -> None:
    hq, hkv, d = heads
    inp = make_inputs(7, heads, DTYPES[dtype], seed=hq + d)
    q = rotary_store_kv_ref(**inp)
    t = inp["qkv"].shape[0]
    qkv = inp["qkv"].reshape(t, hq + 2 * hkv, d)
    exp_q = hf_rotate_half(qkv[:, :hq], inp["cos"], inp["sin"])
    exp_k = hf_rotate_half(qkv[:, hq : hq + hkv], inp["cos"], inp["sin"])
    assert torch.equal(q, exp_q)
    nb, bs = inp["k_cache"].shape[:2]
    k_flat, v_flat = inp["k_cache"].view(nb * bs, hkv, d), inp["v_cache"].view(nb * bs, hkv, d)
    slots = inp["slot_mapping"]
    assert torch.equal(k_flat[slots], exp_k)
    assert torch.equal(v_flat[slots], qkv[:, hq + hkv :])
    others = torch.ones(nb * bs, dtype=torch.bool)
    others[slots] = False
    assert k_flat[others].isnan().all() and v_flat[others].isnan().all(), "slots outside slot_mapping written"
    # rotation preserves each (x1_i, x2_i) pair's norm (float32 only: exact enough to check tightly)
    if dtype == "float32":
        x = qkv[:, :hq].double()
        half = d // 2
        pre = x[..., :half] ** 2 + x[..., half:] ** 2
        post = exp_q.double()[..., :half] ** 2 + exp_q.double()[..., half:] ** 2
        assert torch.allclose(pre, post, rtol=1e-5, atol=1e-6)


def test_public_wrapper_dispatches_to_reference_on_cpu() -> None:
    inp = make_inputs(3, (4, 2, 16), torch.bfloat16)
    ref_inp = clone_caches(inp)
    assert torch.equal(rotary_store_kv(**inp), rotary_store_kv_ref(**ref_inp))
    assert torch.equal(inp["k_cache"].nan_to_num(), ref_inp["k_cache"].nan_to_num())


def test_bad_arguments_raise() -> None:
    inp = make_inputs(3, (4, 2, 16), torch.float32)

    def call(**over) -> None:
        rotary_store_kv(**{**inp, **over})

    with pytest.raises(ValueError, match=r"qkv must be \[num_tokens, .* = 128\], got shape \(3, 112\)"):
        call(qkv=inp["qkv"][:, :112])
    with pytest.raises(ValueError, match=r"cos must be \[num_tokens=3, head_dim/2=8\], got shape \(3, 16\)"):
        call(cos=torch.zeros(3, 16))
    with pytest.raises(ValueError, match="sin must be float32, got torch.bfloat16"):
        call(sin=inp["sin"].bfloat16())
    with pytest.raises(
        ValueError, match=r"slot_mapping must be \[num_tokens=3\] int64, got shape \(3,\) torch.int32"
    ):
        call(slot_mapping=inp["slot_mapping"].int())
    with pytest.raises(ValueError, match="k_cache has 2 kv heads, num_kv_heads is 1"):
        call(num_kv_heads=1, qkv=inp["qkv"][:, :96])
    with pytest.raises(
        ValueError, match=r"num_heads \(3\) must be a positive multiple of num_kv_heads \(2\)"
    ):
        call(num_heads=3)
    with pytest.raises(ValueError, match="k_cache/v_cache must both be"):
        call(v_cache=inp["v_cache"][:-1])
    with pytest.raises(ValueError, match="head_dim must be even"):
        call(k_cache=torch.zeros(6, 4, 2, 15), v_cache=torch.zeros(6, 4, 2, 15))
    with pytest.raises(ValueError, match="cache dtypes"):
        call(k_cache=inp["k_cache"].half(), v_cache=inp["v_cache"].half())
    with pytest.raises(ValueError, match="must be contiguous"):
        nc = torch.zeros(6, 2, 4, 16).transpose(1, 2)
        call(k_cache=nc, v_cache=nc)


def test_triton_launch_on_cpu_needs_interpreter() -> None:
    if is_interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        rotary_store_kv_triton(**make_inputs(2, (4, 2, 16), torch.float32))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
REAL_HEADS = {"gqa_32_8": (32, 8, 128), "mha_32_32": (32, 32, 128)}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("heads", list(REAL_HEADS))
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 512])
def test_gpu_real_shapes_bf16(heads: str, num_tokens: int) -> None:
    inp = make_inputs(
        num_tokens, REAL_HEADS[heads], torch.bfloat16, num_blocks=64, block_size=16, device="cuda", seed=5
    )
    ref_inp = clone_caches(inp)
    q = rotary_store_kv(**inp)
    stats = compare(inp, ref_inp, q, rotary_store_kv_ref(**ref_inp))
    print(f"rotary_store_kv T={num_tokens} {heads} bf16: {stats}")
    for key in ("q", "k_cache", "v_cache"):
        assert stats[key]["max_ulp"] <= 1, (key, stats[key])
    assert stats["v_cache"]["num_diff"] == 0, "v is a copy"
    assert stats["num_written"] == num_tokens


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("dtype", "heads"), [("float16", (16, 4, 64)), ("float32", (8, 8, 128)),
                                              ("bfloat16", (12, 4, 80))])  # fmt: skip
def test_gpu_dtypes_and_dims(dtype: str, heads: tuple) -> None:
    inp = make_inputs(33, heads, DTYPES[dtype], num_blocks=16, block_size=16, device="cuda", row_stride=4096)
    ref_inp = clone_caches(inp)
    stats = compare(inp, ref_inp, rotary_store_kv(**inp), rotary_store_kv_ref(**ref_inp))
    print(f"rotary_store_kv T=33 {heads} {dtype}: {stats}")
    for key in ("q", "k_cache", "v_cache"):
        assert stats[key]["max_ulp"] <= 1, (key, stats[key])


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay_with_new_inputs() -> None:
    kw = dict(num_blocks=64, block_size=16, device="cuda")
    static = make_inputs(16, (32, 8, 128), torch.bfloat16, seed=1, **kw)
    rotary_store_kv(**clone_caches(static))  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = rotary_store_kv(**static)
    for seed in (2, 3):
        new = make_inputs(16, (32, 8, 128), torch.bfloat16, seed=seed, **kw)
        for name in ("qkv", "cos", "sin", "slot_mapping"):
            static[name].copy_(new[name])
        static["k_cache"].fill_(float("nan"))
        static["v_cache"].fill_(float("nan"))
        graph.replay()
        stats = compare(static, new, q, rotary_store_kv_ref(**new))
        assert stats["num_written"] == 16
        for key in ("q", "k_cache", "v_cache"):
            assert stats[key]["max_ulp"] <= 1, (key, stats[key])


if __name__ == "__main__" and sys.argv[1:] == ["--interpreted"]:
    interpreted_main()
