"""SwiGLU (``silu(gate) * up``): Triton kernel vs the torch reference, reference vs the Llama MLP formula.

CPU: the kernel runs under ``TRITON_INTERPRET=1`` in a subprocess (see test_triton_attention.py for
why); this file is that subprocess's script when run with ``--interpreted``. GPU (marked ``gpu``):
real shapes in bf16 and CUDA-graph replay.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from specsched.kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton
from specsched.kernels.testing import interpreted_results, run_jobs
from specsched.kernels.triton_utils import diff_stats, is_interpreted

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# bf16/fp16: the silu is rounded to the dtype before the product, so an exp that differs by an fp32 ulp
# can flip it by one ulp at a rounding boundary (rare: measured 2e-4 of elements in fp16 under the
# interpreter), and that flip times ``up`` can be two ulps of a smaller output; fp32 shows the exp's
# few ulps directly.
MAX_ULP = {"bfloat16": 2, "float16": 2, "float32": 16}


def rounding_matches(stats: dict, dtype: str) -> bool:
    """In bf16/fp16 one-ulp flips must stay rare: skipping the rounding of silu to the dtype before
    the product flips about a quarter of all elements."""
    return dtype == "float32" or stats["num_diff"] <= max(1, 0.01 * stats["numel"])


def make_gate_up(
    num_tokens: int,
    inter: int,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    device: str = "cpu",
    row_stride: int = 0,
) -> torch.Tensor:  # [T, 2 * inter], optionally a column slice of a wider buffer
    gen = torch.Generator(device=device).manual_seed(seed)
    width = max(row_stride, 2 * inter)
    x = (torch.randn(num_tokens, width, generator=gen, device=device) * 4).to(dtype)[:, : 2 * inter]
    if num_tokens > 1 and inter >= 4:  # exp overflow / underflow and zero in the gate
        x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])
    return x


# name: (num_tokens, intermediate, dtype, row stride (0 = contiguous))
CASES: dict[str, tuple] = {
    "t1_i64_bf16": (1, 64, "bfloat16", 0),
    "t3_i200_bf16": (3, 200, "bfloat16", 0),
    "t2_i1500_fp16": (2, 1500, "float16", 0),  # two column blocks, the second masked
    "t4_i96_fp32": (4, 96, "float32", 0),
    "t5_i2100_bf16": (5, 2100, "bfloat16", 0),
    "strided_bf16": (3, 40, "bfloat16", 100),
}


def run_case(num_tokens: int, inter: int, dtype: str, row_stride: int) -> dict:
    x = make_gate_up(num_tokens, inter, DTYPES[dtype], seed=inter, row_stride=row_stride)
    before = x.clone()
    out = silu_and_mul_triton(x)
    return {**diff_stats(out, silu_and_mul_ref(x)), "input_unchanged": bool(torch.equal(x, before))}


def interpreted_main() -> None:
    jobs = {name: (lambda c=case: run_case(*c)) for name, case in CASES.items()}
    jobs["empty"] = lambda: {"shape": list(silu_and_mul_triton(torch.zeros(0, 64)).shape)}
    run_jobs(jobs)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return interpreted_results(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_reference(interpreted: dict, name: str) -> None:
    r = interpreted[name]
    assert "error" not in r, r.get("error")
    print(name, r)
    assert r["max_ulp"] <= MAX_ULP[CASES[name][2]], r
    assert rounding_matches(r, CASES[name][2]), r
    assert r["input_unchanged"]


def test_interpreted_empty_batch(interpreted: dict) -> None:
    assert interpreted["empty"] == {"shape": [0, 32]}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reference_matches_llama_mlp_formula(dtype: str) -> None:
    x = make_gate_up(6, 96, DTYPES[dtype], seed=4)
    gate, up = x[:, :96], x[:, 96:]
    assert torch.equal(silu_and_mul_ref(x), F.silu(gate) * up)
    exact = gate.double() * torch.sigmoid(gate.double()) * up.double()
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}[dtype]
    assert torch.allclose(silu_and_mul_ref(x).double(), exact, rtol=tol, atol=tol)


def test_public_wrapper_dispatches_to_reference_on_cpu() -> None:
    x = make_gate_up(3, 50, torch.bfloat16)
    assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))


def test_bad_arguments_raise() -> None:
    with pytest.raises(
        ValueError, match=r"gate_up must be \[num_tokens, 2 \* intermediate\], got shape \(3, 7\)"
    ):
        silu_and_mul(torch.zeros(3, 7))
    with pytest.raises(ValueError, match=r"got shape \(8,\)"):
        silu_and_mul(torch.zeros(8))
    with pytest.raises(ValueError, match="gate_up must be float32/float16/bfloat16, got torch.int64"):
        silu_and_mul(torch.zeros(2, 8, dtype=torch.int64))


def test_triton_launch_on_cpu_needs_interpreter() -> None:
    if is_interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        silu_and_mul_triton(torch.zeros(2, 8))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 512])
def test_gpu_real_shapes_bf16(num_tokens: int) -> None:
    x = make_gate_up(num_tokens, 11008, torch.bfloat16, device="cuda", seed=num_tokens)
    stats = diff_stats(silu_and_mul(x), silu_and_mul_ref(x))
    print(f"silu_and_mul T={num_tokens} I=11008 bf16: {stats}")
    assert stats["max_ulp"] <= MAX_ULP["bfloat16"] and rounding_matches(stats, "bfloat16")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("dtype", "inter"), [("float16", 14336), ("float32", 1000), ("bfloat16", 1376)])
def test_gpu_dtypes(dtype: str, inter: int) -> None:
    x = make_gate_up(37, inter, DTYPES[dtype], device="cuda", row_stride=2 * inter + 64)
    stats = diff_stats(silu_and_mul(x), silu_and_mul_ref(x))
    print(f"silu_and_mul T=37 I={inter} {dtype}: {stats}")
    assert stats["max_ulp"] <= MAX_ULP[dtype] and rounding_matches(stats, dtype)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay_with_new_inputs() -> None:
    x = make_gate_up(64, 11008, torch.bfloat16, device="cuda", seed=1)
    silu_and_mul(x)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_and_mul(x)
    for seed in (2, 3):
        new = make_gate_up(64, 11008, torch.bfloat16, device="cuda", seed=seed)
        x.copy_(new)
        graph.replay()
        assert diff_stats(out, silu_and_mul_ref(new))["max_ulp"] <= MAX_ULP["bfloat16"]


if __name__ == "__main__" and sys.argv[1:] == ["--interpreted"]:
    interpreted_main()
