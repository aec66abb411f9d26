"""Both scorers' logits match a from-scratch reference forward on the same ragged batch."""

from __future__ import annotations

import random

import pytest
import torch

from specsched.engine.request import Request, SamplingParams
from specsched.kernels.metadata import build_metadata
from specsched.models.config import get_preset
from specsched.models.llama import LlamaForCausalLM
from specsched.models.random_init import init_random
from specsched.proposers.base import Proposals
from specsched.scorers.registry import build_scorers

BLOCK = 4


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return init_random(LlamaForCausalLM(get_preset("tiny")).eval(), seed=0, std=0.1)


def dense_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]
    """Reference: the whole sequence as one prefill row on a fresh contiguous cache."""
    n = len(tokens)
    nb = -(-n // BLOCK) + 1
    kv = model.allocate_kv_cache(nb, BLOCK)
    meta = build_metadata([n], [n], [list(range(1, nb))], BLOCK)
    with torch.inference_mode():
        return model(torch.tensor(tokens), torch.arange(n), meta, kv)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scorers_match_reference_forward(model, seed):
    rng = random.Random(seed)
    vocab = model.cfg.vocab_size
    num_blocks = 200
    free = list(range(1, num_blocks))
    rng.shuffle(free)  # scattered, non-contiguous block tables
    kv = model.allocate_kv_cache(num_blocks, BLOCK)
    reqs, drafts = [], []
    for i in range(7):
        n = rng.randint(1, 40)
        k = [0, 8, rng.randint(0, 8)][i % 3]
        prompt = [rng.randrange(vocab) for _ in range(n)]
        need = -(-(n + k) // BLOCK)
        r = Request(f"r{i}", prompt, SamplingParams(), block_table=[free.pop() for _ in range(need)])
        if n > 1:  # prefill all but the last token
            meta = build_metadata([n - 1], [n - 1], [r.block_table], BLOCK)
            with torch.inference_mode():
                model(torch.tensor(prompt[:-1]), torch.arange(n - 1), meta, kv)
        r.num_computed = n - 1
        reqs.append(r)
        drafts.append([rng.randrange(vocab) for _ in range(k)])
    props = Proposals.from_lists(drafts)
    scorers = build_scorers(["mqa", "batch_expansion"], model, kv, BLOCK)
    got = {name: s.score(reqs, props) for name, s in scorers.items()}
    rows = []
    for r, d in zip(reqs, drafts):
        full = dense_logits(model, r.prompt_ids + d)
        rows.append(full[r.num_tokens - 1 :])
    want = torch.cat(rows)
    assert want.shape[0] == sum(len(d) + 1 for d in drafts)
    for name, logits in got.items():
        assert logits.shape == want.shape, name
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(got["mqa"], got["batch_expansion"], atol=1e-5, rtol=1e-5)


def test_scorer_rejects_mismatched_proposals(model):
    kv = model.allocate_kv_cache(8, BLOCK)
    r = Request("r", [1, 2, 3], SamplingParams(), block_table=[1, 2])
    r.num_computed = 2
    scorer = build_scorers(["mqa"], model, kv, BLOCK)["mqa"]
    with pytest.raises(ValueError, match="proposals cover 2 requests, batch has 1"):
        scorer.score([r], Proposals.from_lists([[1], [2]]))
