"""Our decoder, loaded through our loader, against transformers' own forward and generate (float32).

The greedy loop prefills the prompt in one varlen row, then decodes one token per step, with the
KV cache paged through a shuffled block table (block 0 left unused, as the engine reserves it).
"""

from __future__ import annotations

import pytest
import torch

from specsched.engine.config import ModelConfig
from specsched.kernels.metadata import build_metadata
from specsched.models.llama import LlamaForCausalLM
from specsched.models.loader import load_model

TINY_PROMPTS = [[0, 17, 42, 99, 7], [0, 250, 3, 3, 3, 3, 8, 311, 64, 12, 5, 77, 140, 33, 2, 9, 18]]
SMOLLM2_CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in one sentence what a GPU is.",
]


def shuffled_table(num_tokens: int, block_size: int, seed: int) -> tuple[list[int], int]:
    """A block table of distinct, shuffled ids >= 1 for ``num_tokens`` keys, and the pool size."""
    needed = -(-num_tokens // block_size)
    num_blocks = needed + 4
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(num_blocks - 1, generator=g)[:needed] + 1).tolist(), num_blocks


@torch.no_grad()
def greedy_ours(
    model: LlamaForCausalLM, prompt: list[int], max_new: int, block_size: int, eos: list[int], seed: int = 0
) -> list[int]:
    """Greedy decode with our forward: prefill, then one token per step; stops after an EOS."""
    table, num_blocks = shuffled_table(len(prompt) + max_new, block_size, seed)
    kv = model.allocate_kv_cache(num_blocks, block_size)
    n = len(prompt)
    meta = build_metadata([n], [n], [table], block_size)
    logits = model(torch.tensor(prompt), torch.arange(n), meta, kv, torch.tensor([n - 1]))
    out: list[int] = []
    for step in range(max_new):
        tok = int(logits[-1].argmax())
        out.append(tok)
        if tok in eos or step == max_new - 1:
            break
        pos = n + step
        meta = build_metadata([1], [pos + 1], [table], block_size)
        logits = model(torch.tensor([tok]), torch.tensor([pos]), meta, kv)
    return out


@torch.no_grad()
def greedy_hf(hf_model, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos[0],
    )[0, len(prompt) :].tolist()
    for i, t in enumerate(out):  # cut after the first EOS (generate pads after it)
        if t in eos:
            return out[: i + 1]
    return out


def load_pair(folder, **overrides):
    from transformers import AutoModelForCausalLM

    ours = load_model(
        ModelConfig(source=str(folder), dtype="float32", device="cpu", attn_backend="torch", **overrides)
    )
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return ours, hf


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "llama3_rope", "qwen2"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_tiny_greedy_matches_transformers(make_tiny_hf_dir, kind, block_size):
    ours, hf = load_pair(make_tiny_hf_dir(kind))
    eos = ours.llama_config.eos_token_ids
    for i, prompt in enumerate(TINY_PROMPTS):
        want = greedy_hf(hf, prompt, 24, eos)
        got = greedy_ours(ours.model, prompt, 24, block_size, eos, seed=i)
        assert got == want, f"{kind}, prompt {i}"
        assert len(want) >= 8  # a real comparison, not an immediate EOS


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "qwen2"])
def test_tiny_logits_match_transformers(make_tiny_hf_dir, kind):
    ours, hf = load_pair(make_tiny_hf_dir(kind))
    # long enough that llama3 rope scaling changes the low frequencies' angles noticeably
    prompt = torch.randint(
        0, ours.llama_config.vocab_size, (200,), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        want = hf(prompt[None]).logits[0]
        table, nb = shuffled_table(len(prompt), 16, seed=5)
        meta = build_metadata([len(prompt)], [len(prompt)], [table], 16)
        got = ours.model(prompt, torch.arange(len(prompt)), meta, ours.model.allocate_kv_cache(nb, 16))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_llama3_rope_scaling_is_applied(make_tiny_hf_dir):
    """The llama3 checkpoint must not agree with the same weights under plain RoPE."""
    ours, _ = load_pair(make_tiny_hf_dir("llama3_rope"))
    plain, _ = load_pair(make_tiny_hf_dir("llama3_rope"))
    plain.model.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    prompt = torch.arange(3, 203) % ours.llama_config.vocab_size
    table, nb = shuffled_table(200, 16, seed=1)
    meta = build_metadata([200], [200], [table], 16)
    with torch.no_grad():
        a = ours.model(prompt, torch.arange(200), meta, ours.model.allocate_kv_cache(nb, 16))
        b = plain.model(prompt, torch.arange(200), meta, plain.model.allocate_kv_cache(nb, 16))
    assert (a - b).abs().max() > 1e-3


def test_tiny_chunked_and_batched_prefill_match_transformers(tiny_hf_dir):
    """Two prompts in one varlen batch, the second prefilled in two chunks, give transformers' logits."""
    ours, hf = load_pair(tiny_hf_dir)
    p0, p1 = TINY_PROMPTS
    bs = 4
    t0, nb0 = shuffled_table(len(p0), bs, seed=0)
    t1 = [b + nb0 for b in shuffled_table(len(p1), bs, seed=1)[0]]
    kv = ours.model.allocate_kv_cache(nb0 + 32, bs)
    c = 7  # first chunk of p1
    with torch.no_grad():
        meta = build_metadata([c], [c], [t1], bs)
        ours.model(torch.tensor(p1[:c]), torch.arange(c), meta, kv)
        meta = build_metadata([len(p0), len(p1) - c], [len(p0), len(p1)], [t0, t1], bs)
        ids = torch.tensor(p0 + p1[c:])
        pos = torch.cat([torch.arange(len(p0)), torch.arange(c, len(p1))])
        got = ours.model(ids, pos, meta, kv)
        want0, want1 = hf(torch.tensor([p0])).logits[0], hf(torch.tensor([p1])).logits[0, c:]
    torch.testing.assert_close(got, torch.cat([want0, want1]), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2):
    """transformers' LlamaForCausalLM on the converted SmolLM2 cache entry (a plain HF folder)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2.weights_dir), dtype=torch.float32).eval()


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2, smollm2_hf):
    eos = smollm2.llama_config.eos_token_ids
    for i, text in enumerate(SMOLLM2_CHATS):
        prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        want = greedy_hf(smollm2_hf, prompt, 16, eos)
        got = greedy_ours(smollm2.model, prompt, 16, 16, eos, seed=i)
        assert got == want, (
            f"prompt {text!r}: ours {smollm2.tokenizer.decode(got)!r}, hf {smollm2.tokenizer.decode(want)!r}"
        )
        assert len(want) >= 4
