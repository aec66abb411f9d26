"""flash-attn backend: a clear error where flash-attn is missing; vs the torch reference on CUDA."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from specsched.kernels.attention import get_attention_backend, paged_attention_torch
from specsched.kernels.metadata import build_metadata

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
needs_flash = pytest.mark.skipif(
    not (HAS_FLASH_ATTN and torch.cuda.is_available()), reason="flash_attn is not installed or no CUDA device"
)


@pytest.mark.skipif(HAS_FLASH_ATTN, reason="flash_attn is installed here")
def test_missing_flash_attn_is_reported_clearly() -> None:
    with pytest.raises(ImportError, match="flash-attn is not installed"):
        importlib.import_module("specsched.kernels.flash_attention")
    with pytest.raises(
        RuntimeError, match="backend 'flash_attn' is not usable here: flash-attn is not installed"
    ):
        get_attention_backend("flash_attn")


def _inputs(q_lens: list[int], k_lens: list[int], block_size: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-k // block_size) for k in k_lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i : i + n])
        i += n
    meta = build_metadata(q_lens, k_lens, tables, block_size, "cuda")
    q = torch.randn(sum(q_lens), 32, 128, generator=gen, device="cuda").to(dtype)
    k_cache = torch.randn(num_blocks, block_size, 8, 128, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn_like(k_cache)
    return q, k_cache, v_cache, meta


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_matches_reference(dtype: torch.dtype) -> None:
    paged_attention_flash = get_attention_backend("flash_attn")
    q_lens, k_lens = [1, 4, 0, 6, 200, 1], [2048, 600, 10, 6, 900, 257]
    q, kc, vc, meta = _inputs(q_lens, k_lens, 256, dtype)
    scale = 128**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention_flash(q, kc, vc, meta, scale, out=out)
    ref = paged_attention_torch(q.float(), kc.float(), vc.float(), meta, scale)
    assert not out.isnan().any()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
@needs_flash
def test_flash_rejects_small_blocks_and_fp32() -> None:
    paged_attention_flash = get_attention_backend("flash_attn")
    q, kc, vc, meta = _inputs([1, 2], [20, 40], 16, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 256"):
        paged_attention_flash(q, kc, vc, meta, 1.0)
    q, kc, vc, meta = _inputs([1, 2], [20, 40], 256, torch.float32)
    with pytest.raises(ValueError, match="float16 and bfloat16 only"):
        paged_attention_flash(q, kc, vc, meta, 1.0)
