"""Eager forwards are padded to token buckets on CUDA (a bounded set of GEMM shapes, warmed up at
start-up): the buckets' bounds, and that padding changes no real token's logits."""

from __future__ import annotations

import pytest
import torch

from specsched.engine.config import ModelConfig
from specsched.kernels.metadata import AttentionMetadata
from specsched.models.graph_buckets import token_bucket, token_buckets
from specsched.models.loader import load_model
from specsched.scorers.inputs import chunk_host_inputs


def test_buckets_cover_every_count_with_at_most_an_eighth_of_padding():
    buckets = token_buckets(3000)
    assert buckets[:16] == list(range(1, 17)) and buckets == sorted(set(buckets))
    for n in range(1, 3001):
        b = token_bucket(n)
        assert n <= b <= n * 1.125 and token_bucket(b) == b and b in buckets, n
    assert len(token_buckets(2048)) == 72  # the warm-up's forwards for a 2048-token chunk budget
    assert token_bucket(0) == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_tokens_change_no_real_logits(backend, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
        from specsched.kernels.triton_utils import is_interpreted

        if not is_interpreted():
            pytest.skip("the Triton backend runs on CUDA or under TRITON_INTERPRET=1")
    model = load_model(ModelConfig(source="tiny", device="cpu", dtype="float32", attn_backend=backend),
                       progress=False).model  # fmt: skip
    bs = 4
    kv = model.allocate_kv_cache(64, bs)
    tokens = [[5, 9, 11, 3, 7, 8, 2], [4] * 12, [6, 6, 1]]  # 22 tokens -> bucket 22; drop one: 21 -> 22
    tokens[2] = tokens[2][:2]
    tables = [[1, 2], [3, 4, 5], [6]]
    x = chunk_host_inputs(tokens, [0, 0, 0], tables, bs)
    assert x.num_tokens == 21 and token_bucket(21) == 22
    outs = []
    for pad in (False, True):
        ids, pos, meta, last = x.to_device("cpu", pad_tokens=pad)
        assert isinstance(meta, AttentionMetadata) and ids.shape[0] == (22 if pad else 21)
        with torch.no_grad():
            outs.append(model(ids, pos, meta, kv, last))
        # the real tokens' keys are in their own blocks; the pad token wrote only the pad block 0
        assert meta.slot_mapping[21:].tolist() in ([], [0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[1].argmax(-1), outs[0].argmax(-1))
