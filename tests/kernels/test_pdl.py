"""Programmatic dependent launch (kernels/pdl.py): the switch, and what each kernel compiled for the
H200 with ``USE_PDL`` does before it waits for the kernel before it — no load or store, only L2
prefetches of its weights — read from the PTX compiled here (no device needed). GPU (marked
``gpu``): a forward captured with PDL gives the same logits, bit for bit, as one without."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from specsched.kernels import activation, norm, pdl, rotary, testing  # noqa: E402
from specsched.kernels import fused_linear as fl  # noqa: E402
from specsched.kernels import fused_linear_kernels as flk  # noqa: E402
from specsched.kernels import triton_attention as ta  # noqa: E402
from specsched.kernels.pdl import PdlMode, is_pdl_enabled, pdl_args, pdl_enabled, pdl_mode, set_pdl  # noqa: E402
from specsched.kernels.triton_utils import FP_FUSION, NO_FP_FUSION  # noqa: E402

BF = "*bf16"
GEMM_TYPES = {"x_ptr": BF, "res_ptr": BF, "nw_ptr": BF, "w_ptr": BF, "b_ptr": BF, "y_ptr": BF,
              "res_out_ptr": BF, "eps": "fp32", "inv_k": "fp32"}  # fmt: skip


def _gemm(kernel, n: int, k: int, **constexprs):
    cfg = fl.fused_linear_config(n, k, torch.bfloat16)
    blocks = dict(K=k, BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION="tf32", UPCAST=False,
                  EMULATE_BF16=False, **constexprs)  # fmt: skip
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **NO_FP_FUSION)
    return kernel, GEMM_TYPES, blocks, opts


# name -> (kernel, types, constexprs, options), SmolLM2's shapes; "weights" kernels may load before the wait
KERNELS = {
    "norm_linear": _gemm(flk._norm_linear_kernel, 960, 576, N=960, HAS_RESIDUAL=True, HAS_BIAS=False),
    "norm_swiglu": _gemm(
        flk._norm_swiglu_kernel, 1536, 576, INTER=1536, HAS_RESIDUAL=True, LIBDEVICE_EXP=True
    ),
    "small_linear": _gemm(flk._small_linear_kernel, 576, 1536, N=576, HAS_BIAS=False),
    "rms_norm": (
        norm._rms_norm_kernel,
        {"x_ptr": BF, "res_ptr": BF, "w_ptr": BF, "out_ptr": BF, "res_out_ptr": BF, "eps": "fp32",
         "inv_h": "fp32"},
        dict(H=576, BLOCK=1024, HAS_RESIDUAL=True, EMULATE_BF16=False),
        dict(num_warps=4, **NO_FP_FUSION),
    ),
    "silu_and_mul": (
        activation._silu_and_mul_kernel,
        {"x_ptr": BF, "out_ptr": BF},
        dict(INTER=1536, BLOCK=1024, LIBDEVICE_EXP=True, EMULATE_BF16=False),
        dict(num_warps=4, **NO_FP_FUSION),
    ),
    "rotary_store_kv": (
        rotary._rotary_store_kv_kernel,
        {"qkv_ptr": BF, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_ptr": BF, "kc_ptr": BF, "vc_ptr": BF,
         "slot_ptr": "*i64"},
        dict(NUM_HEADS=9, NUM_KV_HEADS=3, HEAD_DIM=64, HALF_PAD=32, BLOCK_HQ=16, BLOCK_HKV=4, BLOCK_V=256,
             EMULATE_BF16=False),
        dict(num_warps=4, **NO_FP_FUSION),
    ),
    "paged_attention": (
        ta._paged_attn_kernel,
        {**{n: BF for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")},
         **{n: "*i32" for n in ("cu_q_ptr", "seq_k_ptr", "bt_ptr", "ws_nv_ptr")},
         "ws_ml_ptr": "*fp32", "ws_acc_ptr": "*fp32", "scale_log2": "fp32"},
        dict(GROUP=3, GROUP_PAD=4, BLOCK_Q=4, BLOCK_N=64, PAGE=16, HEAD_DIM=64, BLOCK_D=64, NUM_SPLITS=4,
             NUM_HEADS=9, PRECISION="tf32", UPCAST=False, SPLIT_KEYS=0),
        dict(num_warps=4, num_stages=2, **FP_FUSION),
    ),
    "combine_splits": (
        ta._combine_splits_kernel,
        {"o_ptr": BF, "cu_q_ptr": "*i32", "ws_ml_ptr": "*fp32", "ws_acc_ptr": "*fp32"},
        dict(NUM_HEADS=9, NUM_SPLITS=6, SPLITS_PAD=8, HEAD_DIM=64, BLOCK_D=64),
        dict(num_warps=4, **FP_FUSION),
    ),
}  # fmt: skip
PREFETCHES = ("norm_linear", "norm_swiglu", "small_linear", "rms_norm")  # weights prefetched into L2


def _ptx(name: str, use_pdl: bool, trigger_first: bool = False, prefetch: bool = True) -> list[str]:
    kernel, types, constexprs, opts = KERNELS[name]
    extra = {"launch_pdl": True} if use_pdl else {}
    pdl_constexprs = {"USE_PDL": use_pdl, "TRIGGER_FIRST": trigger_first}
    if name in PREFETCHES:
        pdl_constexprs["PREFETCH"] = prefetch
    try:
        asm = testing.compile_sm90(kernel, types, {**constexprs, **pdl_constexprs}, **opts, **extra)
    except (ImportError, TypeError) as e:  # another Triton layout: nothing to check against here
        pytest.skip(f"cannot compile for sm_90 with Triton {triton.__version__}: {e}")
    return asm["ptx"].splitlines()


def _first(lines: list[str], needle: str) -> int | None:
    return next((i for i, line in enumerate(lines) if needle in line), None)


@pytest.mark.parametrize("trigger_first", [False, True], ids=["trigger_after", "trigger_before"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_a_pdl_kernel_neither_stores_nor_reads_activations_before_its_wait(name: str, trigger_first: bool):
    lines = _ptx(name, use_pdl=True, trigger_first=trigger_first)
    wait, trigger = _first(lines, "griddepcontrol.wait"), _first(lines, "griddepcontrol.launch_dependents")
    assert wait is not None and trigger is not None, "PDL instructions missing"
    assert (trigger < wait) == trigger_first  # the mode's order
    before = lines[:wait]
    writes = [x for x in before if "st.global" in x or "atom." in x or "red." in x]
    assert not writes, f"writes before the wait: {writes}"
    loads = [x for x in before if "ld.global" in x or "cp.async" in x]
    assert not loads, f"loads before the wait: {loads}"
    prefetches = [i for i, x in enumerate(lines) if "prefetch.global.L2" in x]
    if name in PREFETCHES:
        assert prefetches and max(prefetches) < wait  # the weights stream while the kernel before runs
    else:
        assert not prefetches


@pytest.mark.parametrize("name", PREFETCHES)
def test_a_kernel_told_not_to_prefetch_does_not(name: str) -> None:
    lines = _ptx(name, use_pdl=True, prefetch=False)
    assert _first(lines, "griddepcontrol.wait") is not None and _first(lines, "prefetch.global") is None


@pytest.mark.parametrize("name", ["norm_swiglu", "rms_norm", "paged_attention"])
def test_without_pdl_a_kernel_compiles_as_before(name: str) -> None:
    lines = _ptx(name, use_pdl=False)
    assert _first(lines, "griddepcontrol") is None and _first(lines, "prefetch.global") is None


def test_the_mode_decides_the_launch_arguments(monkeypatch) -> None:
    """On a capable GPU (faked here): the trigger's place, and a prefetch only for a small weight."""
    monkeypatch.setattr(pdl, "_is_capable", lambda device: True)
    cuda = torch.device("cuda")
    small = torch.empty((512, 1024), dtype=torch.bfloat16, device="meta")  # 1 MB
    large = torch.empty((2048, 1024), dtype=torch.bfloat16, device="meta")  # 4 MB
    with pdl_enabled(PdlMode(on=True, trigger="after", prefetch_max_mb=2.0)):
        assert pdl_args(cuda) == {"USE_PDL": True, "TRIGGER_FIRST": False, "launch_pdl": True}
        assert pdl_args(cuda, small)["PREFETCH"] is True
        assert pdl_args(cuda, large)["PREFETCH"] is False
    with pdl_enabled(PdlMode(on=True, trigger="before")):
        assert pdl_args(cuda)["TRIGGER_FIRST"] is True
    assert pdl_args(cuda, small) == {"USE_PDL": False, "PREFETCH": False}  # off again
    with pytest.raises(ValueError, match="trigger must be one of"):
        PdlMode(on=True, trigger="middle")
    with pytest.raises(ValueError, match="prefetch_max_mb must be >= 0"):
        PdlMode(on=True, prefetch_max_mb=-1)


def test_the_switch_and_where_it_applies() -> None:
    assert not is_pdl_enabled()  # off by default (model.pdl)
    assert pdl_args(torch.device("cpu")) == {"USE_PDL": False}
    assert pdl_args(torch.device("cpu"), torch.zeros(4)) == {"USE_PDL": False, "PREFETCH": False}
    with pdl_enabled(True):
        assert is_pdl_enabled()
        assert pdl_args(torch.device("cpu")) == {"USE_PDL": False}  # never off CUDA
    assert not is_pdl_enabled()  # the previous mode is back
    set_pdl(True)
    try:
        assert is_pdl_enabled()
    finally:
        set_pdl(False)


def test_loading_a_model_sets_the_mode_from_its_config() -> None:
    from specsched.engine.config import ModelConfig
    from specsched.models.loader import load_model

    try:
        cfg = ModelConfig(source="tiny", device="cpu", dtype="float32", pdl=True, pdl_trigger="before",
                          pdl_prefetch_max_mb=2.0)  # fmt: skip
        load_model(cfg, with_tokenizer=False)
        assert pdl_mode() == PdlMode(on=True, trigger="before", prefetch_max_mb=2.0)
        load_model(ModelConfig(source="tiny", device="cpu", dtype="float32"), with_tokenizer=False)
        assert not is_pdl_enabled()
    finally:
        set_pdl(False)


def test_the_model_config_names_a_bad_pdl_setting() -> None:
    from specsched.engine.config import ModelConfig

    with pytest.raises(ValueError, match="model.pdl must be true or false"):
        ModelConfig(source="tiny", pdl="yes")
    with pytest.raises(ValueError, match="model.pdl_trigger must be after or before"):
        ModelConfig(source="tiny", pdl_trigger="first")
    with pytest.raises(ValueError, match="model.pdl_prefetch_max_mb must be >= 0"):
        ModelConfig(source="tiny", pdl_prefetch_max_mb=-1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["unfused", "gemms"])
def test_a_forward_captured_with_pdl_gives_the_same_logits(variant: str) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a Hopper GPU")
    from specsched.bench.common import random_model
    from specsched.bench.fused_linear import decode_batch, graph_of

    model = random_model("smollm2-135m", torch.device("cuda"), torch.bfloat16, is_decisive=False)
    model.set_fused_linear(variant != "unfused", gemms=variant == "gemms")
    logits = {}
    with torch.inference_mode():
        for m in (1, 4, 16):
            ids, pos, meta, kv = decode_batch(model, m, 300)
            batch = (ids, pos, meta, kv)
            for on in (False, True):
                with pdl_enabled(on):
                    graph = graph_of(lambda on=on, b=batch: logits.__setitem__(on, model(*b)))
                graph.replay()
                torch.cuda.synchronize()
            assert torch.equal(logits[False], logits[True]), f"M = {m}"
