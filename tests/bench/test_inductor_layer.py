"""bench.inductor_layer compares like with like: its torch dense parts around our rotary, KV store and
attention give the model's own forward (CPU, float32, uncompiled: the comparison Inductor then
compiles), and the bench refuses to run without CUDA."""

from __future__ import annotations

import pytest
import torch

from specsched.bench.inductor_layer import CompiledLayer, dense_post, dense_pre, forward_with, main
from specsched.engine.config import ModelConfig
from specsched.kernels.metadata import build_metadata
from specsched.models.loader import load_model


def test_the_torch_dense_parts_give_the_models_forward():
    model = load_model(ModelConfig(source="tiny", device="cpu", dtype="float32"), progress=False).model
    block, ctx, m = 4, 9, 3
    per_row = -(-ctx // block)
    kv_a = model.allocate_kv_cache(1 + m * per_row, block)
    kv_b = model.allocate_kv_cache(1 + m * per_row, block)
    tables = [list(range(1 + i * per_row, 1 + (i + 1) * per_row)) for i in range(m)]
    meta = build_metadata([ctx] * m, [ctx] * m, tables, block, torch.device("cpu"))
    ids = torch.randint(3, model.cfg.vocab_size, (m * ctx,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(ctx).repeat(m)
    layers = [CompiledLayer(ly, dense_pre, dense_post) for ly in model.model.layers]
    with torch.inference_mode():
        want = model(ids, pos, meta, kv_a)
        got = forward_with(model, layers, ids, pos, meta, kv_b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (ka, va), (kb, vb) in zip(kv_a, kv_b):  # the same KV written
        torch.testing.assert_close(kb, ka)
        torch.testing.assert_close(vb, va)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_the_bench_needs_cuda(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--rows", "1"])
    assert e.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err
