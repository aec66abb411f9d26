"""Fused small-M linear layers (RMSNorm + linear, RMSNorm + gate/up + SwiGLU) and the plain small-M
linear of the same family: Triton kernels vs the torch references, the references vs the unfused
composition, wrapper errors, batch invariance.

CPU: the kernels run under ``TRITON_INTERPRET=1`` in a subprocess (as test_norm.py); this file is that
subprocess's script when run with ``--interpreted``. GPU (marked ``gpu``): SmolLM2 and 7B shapes in
bf16, row invariance and CUDA-graph replay.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from specsched.kernels.activation import silu_and_mul, silu_and_mul_triton
from specsched.kernels.fused_linear import (
    FusedLinearConfig,
    fused_linear_config,
    norm_linear,
    norm_linear_ref,
    norm_linear_triton,
    norm_swiglu,
    norm_swiglu_ref,
    norm_swiglu_triton,
)
from specsched.kernels.norm import add_rms_norm, rms_norm
from specsched.kernels.small_linear import small_linear, small_linear_ref, small_linear_triton
from specsched.kernels.testing import interpreted_results, run_jobs
from specsched.kernels.triton_utils import diff_stats, is_interpreted

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Tolerance of kernel vs reference, relative to S = sum_k |a_k| |w_k| (+ |bias|), a = the normalised
# input. With u the dtype's unit roundoff: both results are rounded once from fp32 (u|y|
# each, |y| <= S); both fp32 sums, accumulated in different orders, are within K 2^-24 S of the exact
# sum; and the rounded input a may differ by one ulp (2u|a_k|) where the fp32 statistics (or exp)
# differ in the last bits and the value sits at a rounding boundary, a few ulps in fp32 (16 2^-24).
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def tolerance(dtype: str, k: int) -> float:
    return 4 * UNIT_ROUNDOFF[dtype] + (2 * k + 16) * 2.0**-24


def rounding_matches(stats: dict, dtype: str) -> bool:
    """In bf16/fp16 a result differs from the reference only where the two fp32 sums straddle a
    rounding boundary (measured: 0-1 % of elements). Skipping a rounding of the prologue (e.g. the
    normalised row before the weight) moves most sums by about an ulp of the output and flips a large
    share of them."""
    return dtype == "float32" or stats["num_diff"] <= max(2, 0.03 * stats["numel"])


def error_over_bound(y: torch.Tensor, ref: torch.Tensor, a: torch.Tensor, w: torch.Tensor, bias,
                     dtype: str) -> float:  # fmt: skip
    """max |y - ref| / (tolerance * S) over the elements: <= 1 passes."""
    s = a.double().abs() @ w.double().abs().T
    if bias is not None:
        s = s + bias.double().abs()
    err = (y.double() - ref.double()).abs()
    return float((err / (tolerance(dtype, a.shape[1]) * s).clamp_min(1e-300)).max()) if err.numel() else 0.0


def make_norm_inputs(m: int, k: int, n: int, dtype: torch.dtype, *, seed: int = 0, device: str = "cpu",
                     row_stride: int = 0):  # fmt: skip
    """x (optionally a column slice of a wider buffer), residual, norm weight, W, bias; row 0 of x +
    residual is all zeros when m > 2 (its normalised row must be exactly 0)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(m, max(k, row_stride), generator=gen, device=device) * 3).to(dtype)[:, :k]
    residual = (torch.randn(m, k, generator=gen, device=device) * 5).to(dtype)
    if m > 2:
        residual[0] = -x[0]
    norm_w = (1.0 + 0.2 * torch.randn(k, generator=gen, device=device)).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen, device=device).to(dtype)
    return x, residual, norm_w, w, bias


def make_swiglu_inputs(m: int, k: int, inter: int, dtype: torch.dtype, *, seed: int = 0, device: str = "cpu"):
    """x, residual, norm weight, gate/up weight [2 * inter, K]; gate column 0 is scaled so that its
    values reach exp's overflow and underflow (|g| ~ 100), column 1 to |g| ~ 10."""
    x, residual, norm_w, w, _ = make_norm_inputs(m, k, 2 * inter, dtype, seed=seed, device=device)
    w[0] *= 100
    if inter > 1:
        w[1] *= 10
    return x, residual, norm_w, w


def swiglu_bound(ref: torch.Tensor, gate_up_ref: torch.Tensor, a: torch.Tensor, w: torch.Tensor,
                 dtype: str) -> torch.Tensor:  # fmt: skip
    """Per-element bound on |kernel - reference| for SwiGLU over gate/up outputs that may each differ
    by the GEMM tolerance (dg, du: ``tolerance * S``): silu' lies in [-0.1, 1.1], so
    |dh| <= 1.1 dg (|u| + du) + du (|silu(g)| + 1.1 dg) + the two roundings (one ulp of silu(g) times
    |u|, one of h), each 2u."""
    t, unit = tolerance(dtype, a.shape[1]), UNIT_ROUNDOFF[dtype]
    s = a.double().abs() @ w.double().abs().T
    inter = w.shape[0] // 2
    dg, du = t * s[:, :inter], t * s[:, inter:]
    g, u = gate_up_ref.double()[:, :inter], gate_up_ref.double()[:, inter:]
    act = F.silu(g).abs()
    return (
        1.1 * dg * (u.abs() + du)
        + du * (act + 1.1 * dg)
        + 2 * unit * act * (u.abs() + du)
        + 2 * unit * ref.double().abs()
    )


# name: (M, K, N, dtype, residual?, bias?, (block_n, block_k) or None = the default config, row stride)
NORM_CASES: dict[str, tuple] = {
    "m1_k200_n100_bf16_res_bias": (1, 200, 100, "bfloat16", True, True, None, 0),
    "m3_k72_n48_fp16_res": (3, 72, 48, "float16", True, False, None, 0),
    "m16_k136_n64_fp32_bias": (16, 136, 64, "float32", False, True, None, 0),
    "m16_k200_n100_bf16_res_blocks16x32": (16, 200, 100, "bfloat16", True, False, (16, 32), 0),
    "m7_k96_n80_fp32_res_blocks32x32": (7, 96, 80, "float32", True, True, (32, 32), 0),
    "m9_k160_n56_fp16_no_res": (9, 160, 56, "float16", False, False, None, 0),
    "m20_k64_n48_bf16_res_two_row_tiles": (20, 64, 48, "bfloat16", True, True, None, 0),
    "m5_k80_n64_bf16_strided": (5, 80, 64, "bfloat16", True, False, None, 112),
    "m1_k80_n64_fp32_strided": (1, 80, 64, "float32", False, True, None, 112),
}
# name: (M, K, I, dtype, residual?, (block_n, block_k) or None = the default config)
SWIGLU_CASES: dict[str, tuple] = {
    "m1_k200_i100_bf16_res": (1, 200, 100, "bfloat16", True, None),
    "m3_k72_i48_fp16_res": (3, 72, 48, "float16", True, None),
    "m16_k136_i64_fp32": (16, 136, 64, "float32", False, None),
    "m16_k200_i100_bf16_res_blocks16x32": (16, 200, 100, "bfloat16", True, (16, 32)),
    "m7_k96_i80_fp32_res_blocks32x32": (7, 96, 80, "float32", True, (32, 32)),
    "m20_k64_i40_bf16_res_two_row_tiles": (20, 64, 40, "bfloat16", True, None),
}


# name: (M, K, N, dtype, bias?, (block_n, block_k) or None)
SMALL_CASES: dict[str, tuple] = {
    "m1_k200_n100_bf16_bias": (1, 200, 100, "bfloat16", True, None),
    "m4_k72_n48_fp16": (4, 72, 48, "float16", False, None),
    "m16_k136_n64_fp32_bias": (16, 136, 64, "float32", True, None),
    "m9_k96_n80_bf16_blocks32x32": (9, 96, 80, "bfloat16", False, (32, 32)),
    "m20_k64_n48_bf16_two_row_tiles": (20, 64, 48, "bfloat16", True, None),
}


def _config(blocks) -> FusedLinearConfig | None:
    return FusedLinearConfig(*blocks, num_warps=4, num_stages=2) if blocks else None


def run_norm_case(m, k, n, dtype, has_res, has_bias, blocks, row_stride) -> dict:
    x, residual, norm_w, w, bias = make_norm_inputs(m, k, n, DTYPES[dtype], seed=k + m, row_stride=row_stride)
    residual, bias = (residual if has_res else None), (bias if has_bias else None)
    before = [t.clone() for t in (x, residual, norm_w, w) if t is not None]
    y, new_res = norm_linear_triton(x, residual, norm_w, 1e-5, w, bias, config=_config(blocks))
    ref, ref_res = norm_linear_ref(x, residual, norm_w, 1e-5, w, bias)
    normed = add_rms_norm(x, residual, norm_w, 1e-5)[0] if has_res else rms_norm(x, norm_w, 1e-5)
    after = [t for t in (x, residual, norm_w, w) if t is not None]
    return {
        "y": diff_stats(y, ref),
        "error_over_bound": error_over_bound(y, ref, normed, w, bias, dtype),
        "residual_equal": bool(torch.equal(new_res, ref_res)),
        "residual_is_x": new_res is x,
        "inputs_unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
        "zero_row_is_bias": bool(m <= 2 or not has_res or torch.equal(y[0], bias if has_bias else 0 * y[0])),
    }


def run_swiglu_case(m, k, inter, dtype, has_res, blocks) -> dict:
    x, residual, norm_w, w = make_swiglu_inputs(m, k, inter, DTYPES[dtype], seed=k + m)
    residual = residual if has_res else None
    before = [t.clone() for t in (x, residual, norm_w, w) if t is not None]
    config = _config(blocks)
    y, new_res = norm_swiglu_triton(x, residual, norm_w, 1e-5, w, config=config)
    ref, ref_res = norm_swiglu_ref(x, residual, norm_w, 1e-5, w)
    gate_up_ref = norm_linear_ref(x, residual, norm_w, 1e-5, w)[0]
    normed = add_rms_norm(x, residual, norm_w, 1e-5)[0] if has_res else rms_norm(x, norm_w, 1e-5)
    bound = swiglu_bound(ref, gate_up_ref, normed, w, dtype)
    # with the same K chunks, each gate/up output is reduced in the order of norm_linear's kernel: the
    # fused epilogue must then equal the SwiGLU kernel over norm_linear's output bit for bit
    gate_up = norm_linear_triton(x, residual, norm_w, 1e-5, w, config=config or fused_linear_config(
        inter, k, DTYPES[dtype]))[0]  # fmt: skip
    after = [t for t in (x, residual, norm_w, w) if t is not None]
    return {
        "y": diff_stats(y, ref),
        "error_over_bound": float(((y.double() - ref.double()).abs() / bound.clamp_min(1e-300)).max()),
        "equals_unfused_kernels": bool(torch.equal(y, silu_and_mul_triton(gate_up))),
        "residual_equal": bool(torch.equal(new_res, ref_res)),
        "residual_is_x": new_res is x,
        "inputs_unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
    }


def run_small_case(m, k, n, dtype, has_bias, blocks) -> dict:
    x, _, _, w, bias = make_norm_inputs(m, k, n, DTYPES[dtype], seed=k + n + m)
    bias = bias if has_bias else None
    before = [t.clone() for t in (x, w)]
    y = small_linear_triton(x, w, bias, config=_config(blocks))
    ref = small_linear_ref(x, w, bias)
    return {
        "y": diff_stats(y, ref),
        "error_over_bound": error_over_bound(y, ref, x, w, bias, dtype),
        "inputs_unchanged": all(torch.equal(a, b) for a, b in zip(before, (x, w))),
    }


def run_row_invariance(dtype: str) -> dict:
    """Row i of a launch is bitwise the same alone (M = 1), beside other rows, at another row of the
    tile, and in the second 16-row tile (M = 20)."""
    x, residual, norm_w, w, bias = make_norm_inputs(20, 136, 64, DTYPES[dtype], seed=3)
    _, _, _, w_gu = make_swiglu_inputs(20, 136, 40, DTYPES[dtype], seed=4)
    full = norm_linear_triton(x, residual, norm_w, 1e-6, w, bias)[0]
    full_s = norm_swiglu_triton(x, residual, norm_w, 1e-6, w_gu)[0]
    full_l = small_linear_triton(x, w, bias)
    bad = []
    for i in (0, 5, 15, 17):
        alone = norm_linear_triton(x[i : i + 1], residual[i : i + 1], norm_w, 1e-6, w, bias)[0]
        s_alone = norm_swiglu_triton(x[i : i + 1], residual[i : i + 1], norm_w, 1e-6, w_gu)[0]
        others = torch.randn_like(x[:16]) * 7
        others[3] = x[i]
        res_o = torch.randn_like(residual[:16])
        res_o[3] = residual[i]
        moved = norm_linear_triton(others, res_o, norm_w, 1e-6, w, bias)[0][3]
        s_moved = norm_swiglu_triton(others, res_o, norm_w, 1e-6, w_gu)[0][3]
        l_alone = small_linear_triton(x[i : i + 1], w, bias)
        l_moved = small_linear_triton(others, w, bias)[3]
        checks = {
            "alone": torch.equal(alone[0], full[i]),
            "moved": torch.equal(moved, full[i]),
            "swiglu_alone": torch.equal(s_alone[0], full_s[i]),
            "swiglu_moved": torch.equal(s_moved, full_s[i]),
            "small_alone": torch.equal(l_alone[0], full_l[i]),
            "small_moved": torch.equal(l_moved, full_l[i]),
        }
        bad += [f"row {i} {name}" for name, ok in checks.items() if not ok]
    return {"bad": bad}


def run_empty() -> dict:
    x, residual, norm_w, w, bias = make_norm_inputs(0, 64, 48, torch.bfloat16)
    y, new_res = norm_linear_triton(x, residual, norm_w, 1e-5, w, bias)
    s, s_res = norm_swiglu_triton(x, residual, norm_w, 1e-5, w)
    lin = small_linear_triton(x, w, bias)
    return {"shapes": [list(y.shape), list(new_res.shape), list(s.shape), list(s_res.shape), list(lin.shape)]}


def interpreted_main() -> None:
    jobs = {f"norm_{name}": (lambda c=case: run_norm_case(*c)) for name, case in NORM_CASES.items()}
    jobs |= {f"swiglu_{name}": (lambda c=case: run_swiglu_case(*c)) for name, case in SWIGLU_CASES.items()}
    jobs |= {f"small_{name}": (lambda c=case: run_small_case(*c)) for name, case in SMALL_CASES.items()}
    jobs |= {f"invariance_{d}": (lambda d=d: run_row_invariance(d)) for d in ("bfloat16", "float32")}
    jobs["empty"] = run_empty
    run_jobs(jobs)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return interpreted_results(__file__)


@pytest.mark.parametrize("name", list(NORM_CASES))
def test_interpreted_norm_linear_matches_reference(interpreted: dict, name: str) -> None:
    r = interpreted[f"norm_{name}"]
    assert "error" not in r, r.get("error")
    dtype, has_res = NORM_CASES[name][3], NORM_CASES[name][4]
    print(name, r["y"], f"error/bound {r['error_over_bound']:.3f}")
    assert r["error_over_bound"] <= 1.0, r
    assert rounding_matches(r["y"], dtype), r["y"]
    assert r["residual_equal"], "x + residual must round exactly as torch's add"
    assert r["residual_is_x"] == (not has_res), "without a residual the new residual is x itself"
    assert r["inputs_unchanged"], "the kernel wrote into its inputs"
    assert r["zero_row_is_bias"], "an all-zero row must normalise to zeros (y = bias)"


@pytest.mark.parametrize("name", list(SWIGLU_CASES))
def test_interpreted_norm_swiglu_matches_reference(interpreted: dict, name: str) -> None:
    r = interpreted[f"swiglu_{name}"]
    assert "error" not in r, r.get("error")
    dtype, has_res = SWIGLU_CASES[name][3], SWIGLU_CASES[name][4]
    print(name, r["y"], f"error/bound {r['error_over_bound']:.3f}")
    assert r["equals_unfused_kernels"], "SwiGLU in the epilogue must equal norm_linear + silu_and_mul"
    assert r["error_over_bound"] <= 1.0, r
    assert rounding_matches(r["y"], dtype), r["y"]
    assert r["residual_equal"], "x + residual must round exactly as torch's add"
    assert r["residual_is_x"] == (not has_res), "without a residual the new residual is x itself"
    assert r["inputs_unchanged"], "the kernel wrote into its inputs"


@pytest.mark.parametrize("name", list(SMALL_CASES))
def test_interpreted_small_linear_matches_reference(interpreted: dict, name: str) -> None:
    r = interpreted[f"small_{name}"]
    assert "error" not in r, r.get("error")
    print(name, r["y"], f"error/bound {r['error_over_bound']:.3f}")
    assert r["error_over_bound"] <= 1.0, r
    assert rounding_matches(r["y"], SMALL_CASES[name][3]), r["y"]
    assert r["inputs_unchanged"], "the kernel wrote into its inputs"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_interpreted_rows_are_batch_invariant(interpreted: dict, dtype: str) -> None:
    r = interpreted[f"invariance_{dtype}"]
    assert "error" not in r, r.get("error")
    assert r["bad"] == []


def test_interpreted_empty_batch(interpreted: dict) -> None:
    r = interpreted["empty"]
    assert "error" not in r, r.get("error")
    assert r["shapes"] == [[0, 48], [0, 64], [0, 24], [0, 64], [0, 48]]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_references_are_the_unfused_composition(dtype: str) -> None:
    """Bitwise on the CPU: the model's unfused path (norm dispatchers, then F.linear) and the public
    wrappers (which run the references off CUDA)."""
    x, residual, norm_w, w, bias = make_norm_inputs(6, 96, 40, DTYPES[dtype], seed=2)
    normed, new_res = add_rms_norm(x, residual, norm_w, 1e-6)
    for y, r in (norm_linear_ref(x, residual, norm_w, 1e-6, w, bias),
                 norm_linear(x, residual, norm_w, 1e-6, w, bias)):  # fmt: skip
        assert torch.equal(y, F.linear(normed, w, bias)) and torch.equal(r, new_res)
    y, r = norm_linear(x, None, norm_w, 1e-6, w)
    assert torch.equal(y, F.linear(rms_norm(x, norm_w, 1e-6), w)) and r is x
    x, residual, norm_w, w_gu = make_swiglu_inputs(6, 96, 24, DTYPES[dtype], seed=5)
    normed, new_res = add_rms_norm(x, residual, norm_w, 1e-6)
    want = silu_and_mul(F.linear(normed, w_gu))
    for y, r in (
        norm_swiglu_ref(x, residual, norm_w, 1e-6, w_gu),
        norm_swiglu(x, residual, norm_w, 1e-6, w_gu),
    ):
        assert torch.equal(y, want) and torch.equal(r, new_res)
    y, r = norm_swiglu(x, None, norm_w, 1e-6, w_gu)
    assert torch.equal(y, silu_and_mul(F.linear(rms_norm(x, norm_w, 1e-6), w_gu))) and r is x
    for b in (bias, None):
        assert torch.equal(small_linear(x, w, b), F.linear(x, w, b))


def test_bad_arguments_raise() -> None:
    x, residual, norm_w, w, bias = make_norm_inputs(3, 32, 48, torch.float32)
    cases = [
        ((x.view(3, 4, 8), residual, norm_w, 1e-5, w), r"x must be \[M, K > 0\], got shape \(3, 4, 8\)"),
        ((x.long(), None, norm_w, 1e-5, w), "x must be float32/float16/bfloat16, got torch.int64"),
        ((x, residual[:2], norm_w, 1e-5, w), r"residual must be \[3, 32\], got shape \(2, 32\)"),
        ((x, residual.half(), norm_w, 1e-5, w), "residual dtype torch.float16 differs from x dtype"),
        ((x, residual, norm_w[:31], 1e-5, w), r"norm_weight must be \[32\], got shape \(31,\)"),
        ((x, residual, norm_w.bfloat16(), 1e-5, w), "norm_weight dtype torch.bfloat16 differs"),
        ((x, residual, norm_w, 1e-5, w[:, :31]), r"weight must be \[N, K=32\], got shape \(48, 31\)"),
        ((x, residual, norm_w, 1e-5, w[0]), r"weight must be \[N, K=32\], got shape \(32,\)"),
        ((x, residual, norm_w, 1e-5, w.half()), "weight dtype torch.float16 differs from x dtype"),
        ((x, residual, norm_w, 1e-5, w.to("meta")), "weight is on meta, x on cpu"),
        ((x, residual.to("meta"), norm_w, 1e-5, w), "residual is on meta, x on cpu"),
        ((x, residual, norm_w, 1e-5, w, bias[:47]), r"bias must be \[48\], got shape \(47,\)"),
        ((x, residual, norm_w, 1e-5, w, bias.double()), "bias dtype torch.float64 differs"),
    ]  # fmt: skip
    for args, match in cases:
        for fn in (norm_linear, norm_linear_triton):
            with pytest.raises(ValueError, match=match):
                fn(*args)
    x, residual, norm_w, w_gu = make_swiglu_inputs(3, 32, 8, torch.bfloat16)
    cases = [
        ((x[:, :0], None, norm_w[:0], 1e-5, w_gu[:, :0]), r"x must be \[M, K > 0\], got shape \(3, 0\)"),
        ((x, residual[:1], norm_w, 1e-5, w_gu), r"residual must be \[3, 32\], got shape \(1, 32\)"),
        ((x, residual, norm_w.float(), 1e-5, w_gu), "norm_weight dtype torch.float32 differs"),
        ((x, residual, norm_w, 1e-5, w_gu[:15]),
         r"gate_up_weight must be \[2 \* intermediate, K=32\], got shape \(15, 32\)"),
        ((x, residual, norm_w, 1e-5, w_gu[:, :31]),
         r"gate_up_weight must be \[2 \* intermediate, K=32\], got shape \(16, 31\)"),
        ((x, residual, norm_w, 1e-5, w_gu.half()), "gate_up_weight dtype torch.float16 differs from x dtype"),
        ((x, residual, norm_w, 1e-5, w_gu.to("meta")), "gate_up_weight is on meta, x on cpu"),
    ]  # fmt: skip
    for args, match in cases:
        for fn in (norm_swiglu, norm_swiglu_triton):
            with pytest.raises(ValueError, match=f"norm_swiglu: {match}"):
                fn(*args)
    x, _, _, w, bias = make_norm_inputs(3, 32, 48, torch.float16)
    cases = [
        ((x[:, :0], w[:, :0]), r"x must be \[M, K > 0\], got shape \(3, 0\)"),
        ((x.int(), w), "x must be float32/float16/bfloat16, got torch.int32"),
        ((x, w[:, :31]), r"weight must be \[N, K=32\], got shape \(48, 31\)"),
        ((x, w.float()), "weight dtype torch.float32 differs from x dtype torch.float16"),
        ((x, w.to("meta")), "weight is on meta, x on cpu"),
        ((x, w, bias[:47]), r"bias must be \[48\], got shape \(47,\)"),
    ]  # fmt: skip
    for args, match in cases:
        for fn in (small_linear, small_linear_triton):
            with pytest.raises(ValueError, match=f"small_linear: {match}"):
                fn(*args)


def test_triton_launch_on_cpu_needs_interpreter() -> None:
    if is_interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    x, residual, norm_w, w, _ = make_norm_inputs(2, 32, 16, torch.float32)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        norm_linear_triton(x, residual, norm_w, 1e-5, w)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        norm_swiglu_triton(x, residual, norm_w, 1e-5, torch.zeros(8, 32))
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        small_linear_triton(x, w)


# --- GPU -------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (K, N) of norm_linear: SmolLM2-135M's QKV, gate/up, LM head; Llama-2-7B's QKV. (K, I) of norm_swiglu:
# SmolLM2-135M's and Llama-2-7B's MLPs.
GPU_NORM_SHAPES = [(576, 960), (576, 3072), (576, 49152), (4096, 12288)]
GPU_SWIGLU_SHAPES = [(576, 1536), (4096, 11008)]
# (K, N) of small_linear: SmolLM2-135M's output and down projections; Llama-2-7B's
GPU_SMALL_SHAPES = [(576, 576), (1536, 576), (4096, 4096), (11008, 4096)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("shape", GPU_NORM_SHAPES, ids=lambda s: f"k{s[0]}_n{s[1]}")
def test_gpu_norm_linear_real_shapes_bf16(m: int, shape: tuple[int, int]) -> None:
    k, n = shape
    x, residual, norm_w, w, _ = make_norm_inputs(m, k, n, torch.bfloat16, seed=m, device="cuda")
    y, new_res = norm_linear(x, residual, norm_w, 1e-5, w)
    ref, ref_res = norm_linear_ref(x, residual, norm_w, 1e-5, w)
    stats = diff_stats(y, ref)
    ratio = error_over_bound(y, ref, add_rms_norm(x, residual, norm_w, 1e-5)[0], w, None, "bfloat16")
    print(f"norm_linear M={m} K={k} N={n} bf16: {stats}, error/bound {ratio:.3f}")
    assert torch.equal(new_res, ref_res)
    assert ratio <= 1.0 and rounding_matches(stats, "bfloat16"), stats


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("shape", GPU_SWIGLU_SHAPES, ids=lambda s: f"k{s[0]}_i{s[1]}")
def test_gpu_norm_swiglu_real_shapes_bf16(m: int, shape: tuple[int, int]) -> None:
    k, inter = shape
    x, residual, norm_w, w = make_swiglu_inputs(m, k, inter, torch.bfloat16, seed=m, device="cuda")
    y, new_res = norm_swiglu(x, residual, norm_w, 1e-5, w)
    ref, ref_res = norm_swiglu_ref(x, residual, norm_w, 1e-5, w)
    gate_up_ref = norm_linear_ref(x, residual, norm_w, 1e-5, w)[0]
    bound = swiglu_bound(ref, gate_up_ref, add_rms_norm(x, residual, norm_w, 1e-5)[0], w, "bfloat16")
    ratio = float(((y.double() - ref.double()).abs() / bound.clamp_min(1e-300)).max())
    stats = diff_stats(y, ref)
    print(f"norm_swiglu M={m} K={k} I={inter} bf16: {stats}, error/bound {ratio:.3f}")
    assert torch.equal(new_res, ref_res)
    assert ratio <= 1.0 and rounding_matches(stats, "bfloat16"), stats
    # the same K chunks as norm_linear's kernel, then the SwiGLU kernel's arithmetic: bit for bit
    assert torch.equal(y, silu_and_mul(norm_linear(x, residual, norm_w, 1e-5, w)[0]))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("shape", GPU_SMALL_SHAPES, ids=lambda s: f"k{s[0]}_n{s[1]}")
def test_gpu_small_linear_real_shapes_bf16(m: int, shape: tuple[int, int]) -> None:
    k, n = shape
    x, _, _, w, _ = make_norm_inputs(m, k, n, torch.bfloat16, seed=m, device="cuda")
    y, ref = small_linear(x, w), small_linear_ref(x, w)
    stats = diff_stats(y, ref)
    ratio = error_over_bound(y, ref, x, w, None, "bfloat16")
    print(f"small_linear M={m} K={k} N={n} bf16: {stats}, error/bound {ratio:.3f}")
    assert ratio <= 1.0 and rounding_matches(stats, "bfloat16"), stats


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_rows_are_batch_invariant(dtype: str) -> None:
    x, residual, norm_w, w, bias = make_norm_inputs(16, 576, 960, DTYPES[dtype], seed=9, device="cuda")
    _, _, _, w_gu = make_swiglu_inputs(16, 576, 1536, DTYPES[dtype], seed=9, device="cuda")
    full = norm_linear(x, residual, norm_w, 1e-5, w, bias)[0]
    full_s = norm_swiglu(x, residual, norm_w, 1e-5, w_gu)[0]
    full_l = small_linear(x, w, bias)
    for m in (1, 3, 8):
        assert torch.equal(norm_linear(x[:m], residual[:m], norm_w, 1e-5, w, bias)[0], full[:m]), m
        assert torch.equal(norm_swiglu(x[:m], residual[:m], norm_w, 1e-5, w_gu)[0], full_s[:m]), m
        assert torch.equal(small_linear(x[:m], w, bias), full_l[:m]), m


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay_with_new_inputs() -> None:
    x, residual, norm_w, w, bias = make_norm_inputs(4, 576, 3072, torch.bfloat16, seed=1, device="cuda")
    _, _, _, w_gu = make_swiglu_inputs(4, 576, 1536, torch.bfloat16, seed=1, device="cuda")
    norm_linear(x, residual, norm_w, 1e-5, w, bias)  # compile outside capture
    norm_swiglu(x, residual, norm_w, 1e-5, w_gu)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, new_res = norm_linear(x, residual, norm_w, 1e-5, w, bias)
        act, act_res = norm_swiglu(x, residual, norm_w, 1e-5, w_gu)
    for seed in (2, 3):
        x2, r2, *_ = make_norm_inputs(4, 576, 3072, torch.bfloat16, seed=seed, device="cuda")
        x.copy_(x2), residual.copy_(r2)
        graph.replay()
        ref, ref_res = norm_linear_ref(x2, r2, norm_w, 1e-5, w, bias)
        normed = add_rms_norm(x2, r2, norm_w, 1e-5)[0]
        assert torch.equal(new_res, ref_res) and torch.equal(act_res, ref_res)
        assert error_over_bound(y, ref, normed, w, bias, "bfloat16") <= 1.0
        ref_s = norm_swiglu_ref(x2, r2, norm_w, 1e-5, w_gu)[0]
        gate_up_ref = norm_linear_ref(x2, r2, norm_w, 1e-5, w_gu)[0]
        assert ((act.double() - ref_s.double()).abs() <= swiglu_bound(ref_s, gate_up_ref, normed, w_gu,
                                                                       "bfloat16")).all()  # fmt: skip


if __name__ == "__main__" and sys.argv[1:] == ["--interpreted"]:
    interpreted_main()
