"""Our Triton kernels compile for the H200 (sm_90) here, on the CPU:
Triton's frontend and ptxas run without a device. The interpreter (``TRITON_INTERPRET=1``) runs the
kernels as Python and accepts code the compiler rejects (an early ``return`` where the frontend
cannot place it, a loop bound of the wrong kind); this compiles them as the GPU would."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from specsched.kernels import batch_invariant_matmul as mm  # noqa: E402
from specsched.kernels import testing  # noqa: E402
from specsched.kernels import triton_attention as ta  # noqa: E402
from specsched.kernels.triton_utils import FP_FUSION  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget  # noqa: F401
    from triton.compiler import ASTSource  # noqa: F401
except ImportError:  # another Triton layout: nothing to check against here
    pytest.skip("this Triton has no ASTSource / GPUTarget", allow_module_level=True)


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, **options) -> int:
    """Compile ``kernel`` for sm_90 (:func:`specsched.kernels.testing.compile_sm90`); returns the
    cubin's size."""
    try:
        return len(testing.compile_sm90(kernel, types, constexprs, **options)["cubin"])
    except TypeError as e:  # the API moved (not a kernel error)
        pytest.skip(f"ASTSource API differs in Triton {triton.__version__}: {e}")


ATTN_TYPES = {
    **{n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")},
    **{n: "*i32" for n in ("cu_q_ptr", "seq_k_ptr", "bt_ptr", "ws_nv_ptr")},
    "ws_ml_ptr": "*fp32", "ws_acc_ptr": "*fp32", "scale_log2": "fp32",
}  # fmt: skip


@pytest.mark.parametrize(
    "num_splits, split_keys", [(1, 256), (2, 256), (4, 0)], ids=["det", "det_split", "plain"]
)
def test_paged_attention_compiles_for_sm90(num_splits: int, split_keys: int) -> None:
    constexprs = dict(GROUP=3, GROUP_PAD=4, BLOCK_Q=4, BLOCK_N=64, PAGE=16, HEAD_DIM=64, BLOCK_D=64,
                      NUM_SPLITS=num_splits, NUM_HEADS=9, PRECISION="tf32", UPCAST=False,
                      SPLIT_KEYS=split_keys)  # fmt: skip
    assert (
        compile_sm90(ta._paged_attn_kernel, ATTN_TYPES, constexprs, num_warps=4, num_stages=2, **FP_FUSION)
        > 0
    )


def test_fixed_split_merge_compiles_for_sm90() -> None:
    types = {
        "o_ptr": "*bf16",
        "cu_q_ptr": "*i32",
        "ws_ml_ptr": "*fp32",
        "ws_acc_ptr": "*fp32",
        "ws_nv_ptr": "*i32",
    }
    constexprs = dict(NUM_HEADS=9, HEAD_DIM=64, BLOCK_D=64)
    assert compile_sm90(ta._combine_fixed_splits_kernel, types, constexprs, num_warps=4, **FP_FUSION) > 0


@pytest.mark.parametrize("is_partial", [False, True], ids=["one_slice", "split_k"])
def test_batch_invariant_linear_compiles_for_sm90(is_partial: bool) -> None:
    cfg = mm.matmul_config(576, 1536, torch.bfloat16)  # SmolLM2's down projection
    types = {
        "x_ptr": "*bf16",
        "w_ptr": "*bf16",
        "b_ptr": "*bf16",
        "y_ptr": "*fp32" if is_partial else "*bf16",
    }
    constexprs = dict(N=576, K=1536, K_PER_SPLIT=cfg.k_per_split(1536) if is_partial else 1536,
                      IS_PARTIAL=is_partial, HAS_BIAS=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, PRECISION="tf32", UPCAST=False, EMULATE_BF16=False)  # fmt: skip
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **FP_FUSION)
    assert compile_sm90(mm._linear_kernel, types, constexprs, **opts) > 0
    if is_partial:
        types = {"part_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16"}
        constexprs = dict(
            N=576, SPLITS=cfg.num_splits(1536), HAS_BIAS=False, BLOCK_N=1024, EMULATE_BF16=False
        )
        assert compile_sm90(mm._sum_splits_kernel, types, constexprs, num_warps=4, **FP_FUSION) > 0


def test_the_row_kernels_compile_for_sm90() -> None:
    """RMSNorm (with the residual add), SiLU-and-mul and rotary + KV store, with their launch options
    (no FMA contraction), at SmolLM2's shapes."""
    from specsched.kernels import activation, norm, rotary
    from specsched.kernels.triton_utils import NO_FP_FUSION

    bf = "*bf16"
    types = {"x_ptr": bf, "res_ptr": bf, "w_ptr": bf, "out_ptr": bf, "res_out_ptr": bf, "eps": "fp32",
             "inv_h": "fp32"}  # fmt: skip
    constexprs = dict(H=576, BLOCK=1024, HAS_RESIDUAL=True, EMULATE_BF16=False)
    assert compile_sm90(norm._rms_norm_kernel, types, constexprs, num_warps=4, **NO_FP_FUSION) > 0
    types = {"x_ptr": bf, "out_ptr": bf}
    constexprs = dict(INTER=1536, BLOCK=1024, LIBDEVICE_EXP=True, EMULATE_BF16=False)
    assert compile_sm90(activation._silu_and_mul_kernel, types, constexprs, num_warps=4, **NO_FP_FUSION) > 0
    types = {"qkv_ptr": bf, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_ptr": bf, "kc_ptr": bf, "vc_ptr": bf,
             "slot_ptr": "*i64"}  # fmt: skip
    constexprs = dict(NUM_HEADS=9, NUM_KV_HEADS=3, HEAD_DIM=64, HALF_PAD=32, BLOCK_HQ=16, BLOCK_HKV=4,
                      BLOCK_V=256, EMULATE_BF16=False)  # fmt: skip
    assert compile_sm90(rotary._rotary_store_kv_kernel, types, constexprs, num_warps=4, **NO_FP_FUSION) > 0


def test_the_split_merge_and_kv_store_compile_for_sm90() -> None:
    types = {"o_ptr": "*bf16", "cu_q_ptr": "*i32", "ws_ml_ptr": "*fp32", "ws_acc_ptr": "*fp32"}
    constexprs = dict(NUM_HEADS=9, NUM_SPLITS=6, SPLITS_PAD=8, HEAD_DIM=64, BLOCK_D=64)
    assert compile_sm90(ta._combine_splits_kernel, types, constexprs, num_warps=4, **FP_FUSION) > 0
    types = {"k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "slot_ptr": "*i64"}
    assert compile_sm90(ta._store_kv_kernel, types, dict(ROW=192, BLOCK=256), num_warps=4, **FP_FUSION) > 0


# (N, K) of the fused small-M linear layers: SmolLM2-135M's QKV, gate/up, down, LM head; 7B's QKV, down
FUSED_SHAPES = {
    "smollm2_qkv": (960, 576),
    "smollm2_gate_up": (3072, 576),
    "smollm2_swiglu": (1536, 576),
    "smollm2_o_proj": (576, 576),
    "smollm2_down": (576, 1536),
    "smollm2_lm_head": (49152, 576),
    "7b_qkv": (12288, 4096),
    "7b_swiglu": (11008, 4096),
    "7b_down": (4096, 11008),
}


@pytest.mark.parametrize("shape", list(FUSED_SHAPES))
def test_fused_linear_kernels_compile_for_sm90(shape: str) -> None:
    """RMSNorm + linear (with and without the residual add and bias), RMSNorm + gate/up + SwiGLU
    (N = the intermediate size) and the plain small-M linear, bf16, with the launch config
    (:func:`fused_linear_config`) and options (no FMA contraction) they run with."""
    from specsched.kernels import fused_linear as fl
    from specsched.kernels import fused_linear_kernels as flk
    from specsched.kernels.triton_utils import NO_FP_FUSION

    n, k = FUSED_SHAPES[shape]
    cfg = fl.fused_linear_config(n, k, torch.bfloat16)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **NO_FP_FUSION)
    blocks = dict(BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION="tf32", UPCAST=False,
                  EMULATE_BF16=False)  # fmt: skip
    bf = "*bf16"
    types = {"x_ptr": bf, "res_ptr": bf, "nw_ptr": bf, "w_ptr": bf, "b_ptr": bf, "y_ptr": bf,
             "res_out_ptr": bf, "eps": "fp32", "inv_k": "fp32"}  # fmt: skip
    if shape.endswith(("o_proj", "down")):  # the plain small-M linear (model.fused_linear_gemms)
        for has_bias in (False, True):
            constexprs = dict(N=n, K=k, HAS_BIAS=has_bias, **blocks)
            assert compile_sm90(flk._small_linear_kernel, types, constexprs, **opts) > 0
        return
    if shape.endswith("swiglu"):
        for has_residual in (True, False):
            constexprs = dict(INTER=n, K=k, HAS_RESIDUAL=has_residual, LIBDEVICE_EXP=True, **blocks)
            assert compile_sm90(flk._norm_swiglu_kernel, types, constexprs, **opts) > 0
        return
    for has_residual, has_bias in ((True, False), (False, True)):
        constexprs = dict(N=n, K=k, HAS_RESIDUAL=has_residual, HAS_BIAS=has_bias, **blocks)
        assert compile_sm90(flk._norm_linear_kernel, types, constexprs, **opts) > 0


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_fused_linear_kernels_compile_for_sm90_other_dtypes(dtype: str) -> None:
    """fp32 (the tiny model's GPU tests: exact fp32 products, ``ieee``) and fp16, at the tiny preset's
    QKV / MLP shapes (N 128, K 64; I 128, K 64)."""
    from specsched.kernels import fused_linear as fl
    from specsched.kernels import fused_linear_kernels as flk
    from specsched.kernels.triton_utils import NO_FP_FUSION

    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    ptr, precision = f"*{dtype}", "ieee" if dtype == "fp32" else "tf32"
    for n, k, kernel in ((128, 64, flk._norm_linear_kernel), (128, 64, flk._norm_swiglu_kernel)):
        cfg = fl.fused_linear_config(n, k, torch_dtype)
        constexprs = dict(K=k, HAS_RESIDUAL=True, BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                          PRECISION=precision, UPCAST=False, EMULATE_BF16=False)  # fmt: skip
        types = {"x_ptr": ptr, "res_ptr": ptr, "nw_ptr": ptr, "w_ptr": ptr, "b_ptr": ptr, "y_ptr": ptr,
                 "res_out_ptr": ptr, "eps": "fp32", "inv_k": "fp32"}  # fmt: skip
        if kernel is flk._norm_linear_kernel:
            constexprs |= dict(N=n, HAS_BIAS=True)
        else:
            constexprs |= dict(INTER=n, LIBDEVICE_EXP=True)
        opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **NO_FP_FUSION)
        assert compile_sm90(kernel, types, constexprs, **opts) > 0
