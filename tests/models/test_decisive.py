"""make_decisive: random timing weights whose greedy choice survives bf16 noise."""

from __future__ import annotations

import pytest
import torch

from specsched.kernels.metadata import build_metadata
from specsched.models.config import LlamaConfig
from specsched.models.llama import LlamaForCausalLM
from specsched.models.random_init import init_random, make_decisive


def _margins(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:  # [T] (top1 - top2) / |top1|
    n = len(tokens)
    kv = model.allocate_kv_cache(n // 4 + 2, 4)
    meta = build_metadata([n], [n], [list(range(1, n // 4 + 2))], 4)
    with torch.inference_mode():
        logits = model(torch.tensor(tokens), torch.arange(n), meta, kv)
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]) / top[:, 0].abs()


@pytest.mark.parametrize(
    "num_layers, std",
    [
        (4, 0.02),
        # llama2-7b's ratio of sublayer output to embedding, std * hidden * sqrt(2 * layers) = 655:
        # 0.32 * 256 * 8 (a fixed output scale of 0.05 left a min margin of 0.005 here)
        (32, 0.32),
    ],
)
def test_decisive_weights_have_wide_greedy_margins_and_follow_the_permutation(num_layers: int, std: float):
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=4,
        max_position=256,
    )
    tokens = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    plain = init_random(LlamaForCausalLM(cfg).eval(), seed=0, std=std)
    before = _margins(plain, tokens)
    decisive = make_decisive(plain, seed=1)
    after = _margins(decisive, tokens)
    assert after.min() > 0.3, after.min()  # bf16 relative error is ~1e-2
    assert after.median() > 10 * before.median()
    # the next token is a fixed function of the current one
    n = len(tokens)
    kv = decisive.allocate_kv_cache(n // 4 + 2, 4)
    meta = build_metadata([n], [n], [list(range(1, n // 4 + 2))], 4)
    with torch.inference_mode():
        nxt = decisive(torch.tensor(tokens), torch.arange(n), meta, kv).argmax(-1).tolist()
    mapping = {}
    for t, u in zip(tokens, nxt):
        assert mapping.setdefault(t, u) == u
