"""Shared fixtures: tiny random-init HF checkpoints written by transformers itself, a tiny
byte-level BPE tokenizer, and the embedded SmolLM2 model converted once per test session.

SmolLM2's conversion (~25 s) goes to a cache dir under pytest's session tmp dir, so every session
tests a fresh conversion and nothing is written to the user's ~/.cache.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

# One intra-op thread in the test processes and every process they start (daemons, interpreted
# kernels, bench subprocesses inherit the variable): the suite runs on two pytest-xdist workers on a
# two-core machine, and torch's default of a thread per core put 4-6 spinning OpenMP threads on its 2
# cores (tests/engine/test_engine.py: 37 s alone, 137 s inside the suite).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

TINY_SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]  # ids 0, 1, 2
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "Grüße aus Köln! Ça va très bien, merci. 日本語のテキストも少し。 Emoji: 🚀✨",
    "def forward(self, x):\n    return self.proj(x) + x\n",
]
# Shapes of the tiny HF checkpoints: GQA (4 query heads, 2 KV heads), odd intermediate size.
TINY_HF_SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)
TINY_HF_KINDS = ("llama", "llama_tied", "llama3_rope", "qwen2")


def build_tiny_tokenizer(out: Path):
    """A byte-level BPE tokenizer (Llama-2-like: prepends <s>) with a chat template, saved to ``out``."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(TINY_CORPUS * 4, trainer)
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = TINY_CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    return hf


def _randomize(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Spread the weights (transformers' default init of 0.02 gives near-tied logits, and zero biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)


def build_tiny_hf(kind: str, out: Path, vocab_size: int, seed: int = 0) -> Path:
    """Save a random-init transformers checkpoint of ``kind`` (see TINY_HF_KINDS) to ``out``."""
    import transformers

    shape = dict(TINY_HF_SHAPE, vocab_size=vocab_size)
    if kind in ("llama", "llama_tied"):
        cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=kind == "llama_tied", rope_theta=10000.0)
    elif kind == "llama3_rope":
        scaling = dict(
            rope_type="llama3",
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        cfg = transformers.LlamaConfig(**shape, rope_theta=10000.0, rope_scaling=scaling)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(
            **shape, rope_theta=10000.0, use_sliding_window=False, tie_word_embeddings=False
        )
    else:
        raise ValueError(f"unknown tiny HF kind {kind!r}; known: {', '.join(TINY_HF_KINDS)}")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def make_tiny_hf_dir(tmp_path_factory, tiny_tokenizer_dir) -> Callable[[str], Path]:
    """``make(kind)`` -> folder with config.json + model.safetensors + the tiny tokenizer (memoised)."""
    import shutil

    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir)))
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            out = build_tiny_hf(kind, tmp_path_factory.mktemp(f"tiny-hf-{kind}"), vocab)
            for f in tiny_tokenizer_dir.iterdir():
                shutil.copy2(f, out / f.name)
            made[kind] = out
        return made[kind]

    return make


@pytest.fixture(scope="session")
def tiny_hf_dir(make_tiny_hf_dir) -> Path:
    """Random-init Llama (GQA, untied) saved by transformers, with the tiny tokenizer."""
    return make_tiny_hf_dir("llama")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from specsched.models.smollm2 import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 not available: {e}")


@pytest.fixture(scope="session")
def smollm2_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("specsched-cache")


@pytest.fixture(scope="session")
def smollm2(smollm2_path, smollm2_cache_dir):
    """SmolLM2-135M-Instruct as a LoadedModel (float32, CPU, torch attention), converted once."""
    from specsched.engine.config import ModelConfig
    from specsched.models.loader import load_model

    cfg = ModelConfig(
        source="smollm2",
        dtype="float32",
        device="cpu",
        attn_backend="torch",
        cache_dir=str(smollm2_cache_dir),
    )
    return load_model(cfg, progress=False)


@pytest.fixture
def decoding_batch() -> Callable:
    """``decoding_batch(model, kv, rng, num, max_k=5, max_len=40, block=4) -> (requests, proposals)``:
    requests whose prompts are prefilled into ``kv`` (all but the last token, blocks drawn at random
    from the pool, block 0 left as the pad block) and ragged random drafts (0 and ``max_k`` included),
    on the model's device. For the graph runner and graph scorer tests."""
    import random

    from specsched.engine.request import Request, SamplingParams
    from specsched.kernels.metadata import build_metadata
    from specsched.proposers.base import Proposals

    def make(model, kv, rng: random.Random, num: int, max_k: int = 5, max_len: int = 40, block: int = 4):
        vocab, device = model.cfg.vocab_size, model.lm_head.weight.device
        free = list(range(1, kv[0][0].shape[0]))
        rng.shuffle(free)
        reqs, drafts = [], []
        for i in range(num):
            n = rng.randint(2, max_len)
            k = rng.choice([0, max_k, rng.randint(0, max_k)])
            prompt = [rng.randrange(vocab) for _ in range(n)]
            table = [free.pop() for _ in range(-(-(n + k) // block))]
            r = Request(f"r{i}", prompt, SamplingParams(), block_table=table)
            meta = build_metadata([n - 1], [n - 1], [r.block_table], block, device)
            with torch.inference_mode():
                model(torch.tensor(prompt[:-1], device=device), torch.arange(n - 1, device=device), meta, kv)
            r.num_computed = n - 1
            reqs.append(r)
            drafts.append([rng.randrange(vocab) for _ in range(k)])
        return reqs, Proposals.from_lists(drafts, device)

    return make
