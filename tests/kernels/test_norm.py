"""RMSNorm and fused add + RMSNorm: Triton kernels vs the torch references, references vs the Llama formula.

CPU: the kernels run under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set before
triton is imported, and other test files import triton first); this file is that subprocess's script
when run with ``--interpreted``. GPU (marked ``gpu``): real shapes in bf16 and CUDA-graph replay.
"""

from __future__ import annotations

import sys

import pytest
import torch

from specsched.kernels.norm import (
    add_rms_norm,
    add_rms_norm_ref,
    add_rms_norm_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
)
from specsched.kernels.testing import interpreted_results, run_jobs
from specsched.kernels.triton_utils import diff_stats, is_interpreted

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Tolerances of kernel vs reference: the fp32 statistics differ only in summation order, so in bf16/fp16
# the normalised row can flip by one ulp at a rounding boundary (rare: measured 2e-5 of elements in
# fp16, none in bf16), and that flip times the weight can be two ulps of a smaller output; fp32 keeps
# the few ulps of the statistics.
MAX_ULP = {"bfloat16": 2, "float16": 2, "float32": 16}


def rounding_matches(stats: dict, dtype: str) -> bool:
    """In bf16/fp16 one-ulp flips must stay rare: rounding at other points than the reference (e.g.
    not rounding the normalised row before the weight) flips about a quarter of all elements."""
    return dtype == "float32" or stats["num_diff"] <= max(1, 0.01 * stats["numel"])


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula of models/llama.py's RMSNorm.forward, written out independently."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def make_inputs(
    num_tokens: int,
    hidden: int,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    device: str = "cpu",
    row_stride: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (optionally a column slice of a wider buffer), residual and weight; row 0 of x is all zeros."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = max(row_stride, hidden)
    buf = (torch.randn(num_tokens, width, generator=gen, device=device) * 3).to(dtype)
    x = buf[:, :hidden]
    if num_tokens > 2:
        x[0] = 0  # var = 0: the output must be exactly 0, not NaN
    residual = (torch.randn(num_tokens, hidden, generator=gen, device=device) * 5).to(dtype)
    weight = (1.0 + 0.2 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
    return x, residual, weight


# name: (num_tokens, hidden, dtype, eps, row stride of x (0 = contiguous))
CASES: dict[str, tuple] = {
    "t1_h64_bf16": (1, 64, "bfloat16", 1e-5, 0),
    "t7_h96_bf16": (7, 96, "bfloat16", 1e-6, 0),
    "t33_h320_bf16": (33, 320, "bfloat16", 1e-5, 0),
    "t5_h200_fp16": (5, 200, "float16", 1e-5, 0),
    "t6_h96_fp32": (6, 96, "float32", 1e-5, 0),
    "t4_h1000_fp32": (4, 1000, "float32", 1e-6, 0),
    "strided_bf16": (5, 80, "bfloat16", 1e-5, 112),
}


def run_case(num_tokens: int, hidden: int, dtype: str, eps: float, row_stride: int) -> dict:
    x, residual, weight = make_inputs(num_tokens, hidden, DTYPES[dtype], seed=hidden, row_stride=row_stride)
    x_before, r_before = x.clone(), residual.clone()
    out = rms_norm_triton(x, weight, eps)
    normed, new_res = add_rms_norm_triton(x, residual, weight, eps)
    ref_normed, ref_res = add_rms_norm_ref(x, residual, weight, eps)
    buf = torch.full((num_tokens, hidden + 8), 7.0, dtype=x.dtype)  # rows strided: a static buffer's view
    normed_buf, res_buf = add_rms_norm_triton(x, residual, weight, eps, residual_out=buf[:, :hidden])
    return {
        "norm": diff_stats(out, rms_norm_ref(x, weight, eps)),
        "add_norm": diff_stats(normed, ref_normed),
        "residual": diff_stats(new_res, ref_res),
        "residual_out_ok": bool(
            res_buf.data_ptr() == buf.data_ptr()
            and torch.equal(res_buf, new_res)
            and torch.equal(normed_buf, normed)
            and (buf[:, hidden:] == 7).all()
        ),
        "inputs_unchanged": bool(torch.equal(x, x_before) and torch.equal(residual, r_before)),
        "zero_row_ok": bool(num_tokens <= 2 or (out[0] == 0).all()),
    }


def run_empty() -> dict:
    x, residual, weight = make_inputs(0, 64, torch.bfloat16)
    normed, new_res = add_rms_norm_triton(x, residual, weight, 1e-5)
    return {"shapes": [list(rms_norm_triton(x, weight, 1e-5).shape), list(normed.shape), list(new_res.shape)]}


def interpreted_main() -> None:
    jobs = {name: (lambda c=case: run_case(*c)) for name, case in CASES.items()}
    jobs["empty"] = run_empty
    run_jobs(jobs)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return interpreted_results(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_reference(interpreted: dict, name: str) -> None:
    r = interpreted[name]
    assert "error" not in r, r.get("error")
    dtype = CASES[name][2]
    print(name, {k: r[k] for k in ("norm", "add_norm", "residual")})
    for key in ("norm", "add_norm"):
        assert r[key]["max_ulp"] <= MAX_ULP[dtype], r[key]
        assert rounding_matches(r[key], dtype), r[key]
    assert r["residual"]["max_ulp"] == 0, "x + residual must round exactly as torch's add"
    assert r["inputs_unchanged"], "the kernel wrote into its inputs"
    assert r["residual_out_ok"], "residual_out: the same residual, written into the given rows only"
    assert r["zero_row_ok"], "an all-zero row must normalise to zeros"


def test_interpreted_empty_batch(interpreted: dict) -> None:
    r = interpreted["empty"]
    assert "error" not in r, r.get("error")
    assert r["shapes"] == [[0, 64]] * 3


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("hidden", [64, 96, 4096])
def test_references_match_llama_formula(dtype: str, hidden: int) -> None:
    x, residual, weight = make_inputs(9, hidden, DTYPES[dtype], seed=1)
    assert torch.equal(rms_norm_ref(x, weight, 1e-5), llama_rms_norm(x, weight, 1e-5))
    normed, new_res = add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(new_res, x + residual)
    assert torch.equal(normed, llama_rms_norm(x + residual, weight, 1e-6))
    # and the formula is an RMSNorm: float64 within the dtype's rounding
    x64 = x.double()
    exact = weight.double() * x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    tol = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}[dtype]
    assert torch.allclose(rms_norm_ref(x, weight, 1e-5).double(), exact, rtol=tol, atol=tol)


def test_public_wrappers_dispatch_to_reference_on_cpu() -> None:
    x, residual, weight = make_inputs(4, 48, torch.bfloat16)
    assert torch.equal(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    for a, b in zip(add_rms_norm(x, residual, weight, 1e-5), add_rms_norm_ref(x, residual, weight, 1e-5)):
        assert torch.equal(a, b)


def test_bad_arguments_raise() -> None:
    x, residual, weight = make_inputs(3, 32, torch.float32)
    with pytest.raises(ValueError, match=r"x must be \[num_tokens, hidden\], got shape \(3, 4, 8\)"):
        rms_norm(x.view(3, 4, 8), weight, 1e-5)
    with pytest.raises(ValueError, match=r"weight must be \[hidden=32\], got shape \(31,\)"):
        rms_norm(x, weight[:31], 1e-5)
    with pytest.raises(ValueError, match="weight dtype torch.bfloat16 differs"):
        rms_norm(x, weight.bfloat16(), 1e-5)
    with pytest.raises(ValueError, match=r"residual must have x's shape \(3, 32\), got shape \(2, 32\)"):
        add_rms_norm(x, residual[:2], weight, 1e-5)
    with pytest.raises(ValueError, match="residual dtype torch.float16 differs"):
        add_rms_norm(x, residual.half(), weight, 1e-5)
    with pytest.raises(ValueError, match="x must be float32/float16/bfloat16, got torch.float64"):
        rms_norm(x.double(), weight.double(), 1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_triton(x, weight[:5], 1e-5)
    with pytest.raises(ValueError, match="hidden size 40000 exceeds"):
        rms_norm(torch.zeros(1, 40000), torch.zeros(40000), 1e-5)


def test_triton_launch_on_cpu_needs_interpreter() -> None:
    if is_interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    x, residual, weight = make_inputs(2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        rms_norm_triton(x, weight, 1e-5)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        add_rms_norm_triton(x, residual, weight, 1e-5)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 512])
def test_gpu_real_shapes_bf16(num_tokens: int) -> None:
    x, residual, weight = make_inputs(num_tokens, 4096, torch.bfloat16, device="cuda", seed=num_tokens)
    out = rms_norm(x, weight, 1e-5)
    normed, new_res = add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_res = add_rms_norm_ref(x, residual, weight, 1e-5)
    s_norm = diff_stats(out, rms_norm_ref(x, weight, 1e-5))
    s_add = diff_stats(normed, ref_normed)
    print(f"rms_norm T={num_tokens} H=4096 bf16: {s_norm}; add_rms_norm: {s_add}")
    assert torch.equal(new_res, ref_res)
    assert s_norm["max_ulp"] <= MAX_ULP["bfloat16"] and s_add["max_ulp"] <= MAX_ULP["bfloat16"]
    assert rounding_matches(s_norm, "bfloat16") and rounding_matches(s_add, "bfloat16")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("dtype", "hidden"), [("float16", 8192), ("float32", 5120), ("bfloat16", 2000)])
def test_gpu_dtypes(dtype: str, hidden: int) -> None:
    x, residual, weight = make_inputs(37, hidden, DTYPES[dtype], device="cuda", row_stride=hidden + 64)
    normed, new_res = add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_res = add_rms_norm_ref(x, residual, weight, 1e-6)
    stats = diff_stats(normed, ref_normed)
    print(f"add_rms_norm T=37 H={hidden} {dtype}: {stats}")
    assert torch.equal(new_res, ref_res)
    assert stats["max_ulp"] <= MAX_ULP[dtype] and rounding_matches(stats, dtype)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay_with_new_inputs() -> None:
    x, residual, weight = make_inputs(64, 4096, torch.bfloat16, device="cuda", seed=1)
    add_rms_norm(x, residual, weight, 1e-5)  # compile outside capture
    rms_norm(x, weight, 1e-5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, new_res = add_rms_norm(x, residual, weight, 1e-5)
        out = rms_norm(new_res, weight, 1e-5)
    for seed in (2, 3):
        x2, r2, _ = make_inputs(64, 4096, torch.bfloat16, device="cuda", seed=seed)
        x.copy_(x2)
        residual.copy_(r2)
        graph.replay()
        ref_normed, ref_res = add_rms_norm_ref(x2, r2, weight, 1e-5)
        assert torch.equal(new_res, ref_res)
        assert diff_stats(normed, ref_normed)["max_ulp"] <= MAX_ULP["bfloat16"]
        assert diff_stats(out, rms_norm_ref(ref_res, weight, 1e-5))["max_ulp"] <= MAX_ULP["bfloat16"]


if __name__ == "__main__" and sys.argv[1:] == ["--interpreted"]:
    interpreted_main()
