"""The two end-to-end suites: synthetic acceptance on random 7B-shaped weights, and a real model."""

from __future__ import annotations

import logging

import torch

from specsched.bench.common import EngineSpec, blocks_for, graph_config, random_model, random_prompts
from specsched.bench.e2e import E2ERow, RunConfig, baseline_run, policy_configs, run_grid
from specsched.bench.prompts import chat_prompts
from specsched.engine.config import ModelConfig, NgramConfig
from specsched.proposers.draft import DraftModelProposer
from specsched.proposers.none import NoProposer
from specsched.proposers.synthetic import SyntheticProposer, attach_oracle
from specsched.scorers.graph import attach_draft_graphs, build_prefill_runner
from specsched.scorers.registry import build_scorers

logger = logging.getLogger(__name__)


def run_synthetic_suite(
    cfg, graphs_cfg, device: torch.device, dtype: torch.dtype, block_size: int, seed: int
) -> list[E2ERow]:
    """``bench.e2e``: target preset + draft preset, synthetic acceptance a in ``cfg.acceptance``."""
    target = random_model(cfg.target, device, dtype, seed)
    draft = random_model(cfg.draft, device, dtype, seed + 1)
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"draft vocab {draft.cfg.vocab_size} != target vocab {target.cfg.vocab_size}")
    max_b = max(cfg.batch)
    max_len = cfg.prompt_len + cfg.max_new_tokens + cfg.warmup_tokens + cfg.max_k + 2
    num_blocks = blocks_for(max_b, max_len, block_size)
    kv = target.allocate_kv_cache(num_blocks, block_size)
    gcfg = graph_config(graphs_cfg, max_b, cfg.max_k, max_len)
    scorers = build_scorers(list(cfg.scorers), target, kv, block_size, gcfg)
    draft_prop = DraftModelProposer(draft, draft.allocate_kv_cache(num_blocks, block_size), block_size)
    attach_draft_graphs(draft_prop, gcfg, block_size)
    spec = EngineSpec(
        target, kv, num_blocks, block_size, scorers, max_b, cfg.max_k, max_len,
        list(target.cfg.eos_token_ids), None, f"{cfg.target}+{cfg.draft}",
        prefill_runner=build_prefill_runner(target, kv, block_size, gcfg),
    )  # fmt: skip
    none = NoProposer(device)
    rows: list[E2ERow] = []
    for b in cfg.batch:
        # at least ``min_prompts``, timed in groups of b: a batch-1 row over one prompt is ~50 steps,
        # and run-to-run spread at that length is as large as the differences between policies
        n = max(b, cfg.min_prompts)
        prompts = random_prompts(target.cfg.vocab_size, n, cfg.prompt_len, seed + b)
        try:
            base, outputs = baseline_run("synthetic", spec, b, prompts, cfg, none)
        except Exception as e:
            logger.exception("synthetic baseline at batch %d failed", b)
            rows.append(failed_baseline("synthetic", spec.name, b, e))
            continue
        rows.append(base)
        for a in cfg.acceptance:
            synth = SyntheticProposer(target, a, block_size, seed, draft=draft_prop)
            attach_oracle(synth, prompts, outputs)
            runs = [
                RunConfig(
                    e.label,
                    e.make,
                    {"none": none, "synthetic": synth},
                    "synthetic",
                    e.scheduler,
                    e.draft_loop,
                )
                for e in policy_configs(cfg, list(scorers))
            ]
            label = f"synthetic a={a} (+{cfg.draft})"
            rows += run_grid("synthetic", spec, b, prompts, runs, cfg, a, label, base, outputs)
    return rows


def failed_baseline(suite: str, model: str, batch: int, e: Exception) -> E2ERow:
    error = f"{type(e).__name__}: {e}"[:300]
    return E2ERow(suite, model, "none", None, batch, "non-speculative", error=error)


def real_prompt_ids(tokenizer, vocab: int, num: int, seed: int) -> tuple[list[list[int]], str]:
    """Chat prompts through the model's template; token-id motifs when it has no tokenizer."""
    if tokenizer is not None and getattr(tokenizer, "has_chat_template", False):
        return [tokenizer.apply_chat_template(m) for m in chat_prompts(num)], "chat prompts"
    return random_prompts(vocab, num, 64, seed, motif=True), "token-id motif prompts (no tokenizer)"


def run_real_suite(
    cfg, graphs_cfg, device: torch.device, dtype: torch.dtype, block_size: int, seed: int
) -> list[E2ERow]:
    """``bench.real``: a real model (``cfg.source``) with its self-draft and/or n-gram."""
    from specsched.models.loader import load_model
    from specsched.proposers.ngram import NgramProposer

    dtype_name = str(dtype).replace("torch.", "")
    loaded = load_model(ModelConfig(source=cfg.source, device=str(device), dtype=dtype_name, seed=seed))
    model = loaded.model
    prompts, note = real_prompt_ids(loaded.tokenizer, model.cfg.vocab_size, cfg.num_prompts, seed)
    max_b = max(cfg.batch)
    max_len = min(max(map(len, prompts)) + cfg.max_new_tokens + cfg.warmup_tokens + cfg.max_k + 2,
                  loaded.max_model_len)  # fmt: skip
    num_blocks = blocks_for(max_b, max_len, block_size)
    kv = model.allocate_kv_cache(num_blocks, block_size)
    gcfg = graph_config(graphs_cfg, max_b, cfg.max_k, max_len)
    scorers = build_scorers(list(cfg.scorers), model, kv, block_size, gcfg)
    eos = list(loaded.llama_config.eos_token_ids)
    spec = EngineSpec(model, kv, num_blocks, block_size, scorers, max_b, cfg.max_k, max_len, eos,
                      loaded.tokenizer, loaded.name,
                      prefill_runner=build_prefill_runner(model, kv, block_size, gcfg))  # fmt: skip
    none = NoProposer(device)
    proposers: dict[str, object] = {}
    for name in cfg.proposers:
        if name == "draft":
            layers = min(cfg.draft_layers, model.cfg.num_layers)
            draft_kv = model.allocate_kv_cache(num_blocks, block_size, layers)
            p = DraftModelProposer(model, draft_kv, block_size, layers)
            attach_draft_graphs(p, gcfg, block_size)
            proposers[f"draft (self, {layers} layers)"] = p
        elif name == "ngram":
            proposers["ngram"] = NgramProposer(NgramConfig(), device)
        else:
            raise ValueError(f"bench.real.proposers: unknown proposer {name!r}; known: draft, ngram")
    rows: list[E2ERow] = []
    for b in cfg.batch:
        try:
            base, reference = baseline_run("real", spec, b, prompts, cfg, none)
        except Exception as e:
            logger.exception("real baseline at batch %d failed", b)
            rows.append(failed_baseline("real", spec.name, b, e))
            continue
        base.note = note
        rows.append(base)
        for label, prop in proposers.items():
            key = "draft" if isinstance(prop, DraftModelProposer) else "ngram"
            runs = [
                RunConfig(e.label, e.make, {"none": none, key: prop}, key, e.scheduler, e.draft_loop)
                for e in policy_configs(cfg, list(scorers))
            ]
            rows += run_grid("real", spec, b, prompts, runs, cfg, None, label, base, reference)
    return rows
