"""The peer on the same device and prompts: transformers' ``generate`` at batch 1 — plain, with an
``assistant_model`` (the model's own first L layers) and with ``prompt_lookup_num_tokens``.

Greedy, exactly ``max_new_tokens`` per prompt (``min_new_tokens`` keeps EOS from ending early, as
``ignore_eos`` does for specsched), each prompt timed alone between ``torch.cuda.synchronize``
calls after one short warm-up generate per method.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specsched.bench.common import sync

logger = logging.getLogger(__name__)


@dataclass
class PeerRow:
    method: str
    tokens_per_s: float = float("nan")
    ms_per_token: float = float("nan")
    num_tokens: int = 0
    num_prompts: int = 0
    error: str = ""


def hf_folder(source: str) -> Path:
    """An HF folder for ``source``: the loader's converted cache entry for ``smollm2`` / a ``.gguf``
    file (converted once), or the folder itself."""
    from specsched.models.loader import convert_gguf, default_cache_dir
    from specsched.models.smollm2 import SMOLLM2_NAME, smollm2_gguf_path

    if source == "smollm2":
        return convert_gguf(smollm2_gguf_path(), default_cache_dir(), SMOLLM2_NAME)
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        return convert_gguf(path, default_cache_dir(), path.stem)
    if path.is_dir():
        return path
    raise ValueError(f"bench.peers.source {source!r} is neither smollm2, a .gguf file nor an HF folder")


def load_hf_models(source: str, assistant_layers: int, device: torch.device, dtype: torch.dtype):
    """(model, assistant with the first ``assistant_layers`` layers, folder)."""
    from transformers import AutoModelForCausalLM

    folder = hf_folder(source)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    assistant = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, num_hidden_layers=assistant_layers
    ).to(device).eval()  # fmt: skip
    return model, assistant, folder


def time_hf_generate(
    model, prompts: list[list[int]], max_new_tokens: int, warmup_tokens: int = 16, **kwargs
) -> PeerRow:
    """Time ``model.generate`` on each prompt alone (batch 1) after one short untimed warm-up."""
    device = model.device
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos

    def one(ids: list[int], n: int) -> int:
        x = torch.tensor([ids], device=device)
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=pad, **kwargs)  # fmt: skip
        return out.shape[1] - x.shape[1]

    with torch.inference_mode():
        one(prompts[0], min(warmup_tokens, max_new_tokens))
        wall, tokens = 0.0, 0
        for ids in prompts:
            sync(device)
            t0 = time.perf_counter()
            tokens += one(ids, max_new_tokens)
            sync(device)
            wall += time.perf_counter() - t0
    return PeerRow("", tokens / wall, wall * 1e3 / tokens, tokens, len(prompts))


def run_peers(model, assistant, prompts: list[list[int]], cfg) -> list[PeerRow]:
    """Each method of ``cfg.methods`` (plain | assistant | prompt_lookup); errors become rows."""
    methods = {
        "plain": ("transformers generate (plain)", {}),
        "assistant": (f"transformers generate, assistant_model = first {cfg.assistant_layers} layers",
                      {"assistant_model": assistant}),
        "prompt_lookup": (f"transformers generate, prompt_lookup_num_tokens={cfg.prompt_lookup_num_tokens}",
                          {"prompt_lookup_num_tokens": cfg.prompt_lookup_num_tokens}),
    }  # fmt: skip
    rows = []
    for name in cfg.methods:
        if name not in methods:
            raise ValueError(f"bench.peers.methods: unknown {name!r}; known: {', '.join(methods)}")
        label, kwargs = methods[name]
        try:
            row = time_hf_generate(model, prompts, cfg.max_new_tokens, **kwargs)
        except Exception as e:
            logger.exception("peer %s failed", label)
            row = PeerRow("", error=f"{type(e).__name__}: {e}"[:300])
        row.method = label
        logger.info("peer %s: %.1f tok/s", label, row.tokens_per_s)
        rows.append(row)
    return rows


def run_peer_suite(cfg, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """``bench.peers`` on the real prompts, through the source's tokenizer chat template."""
    from specsched.bench.prompts import chat_prompts
    from specsched.models.tokenizer import Tokenizer

    model, assistant, folder = load_hf_models(cfg.source, cfg.assistant_layers, device, dtype)
    tok = Tokenizer.from_pretrained(folder)
    prompts = [tok.apply_chat_template(m) for m in chat_prompts(cfg.num_prompts)]
    return [asdict(r) for r in run_peers(model, assistant, prompts, cfg)]
