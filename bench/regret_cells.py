"""The cells of ``bench=regret`` (:mod:`specsched.bench.regret` runs them): the 7B pair at each batch
size and synthetic acceptance, and a real model with each proposer on real prompts. Each
:class:`Cell` holds its engine parts, its configs (non-speculative first, then the fixed grid and
the policies of :func:`specsched.bench.e2e.policy_configs`) and one pass of prompts."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specsched.bench.common import (
    EngineSpec,
    blocks_for,
    graph_config,
    make_engine,
    random_model,
    random_prompts,
    warm_up_spec,
)
from specsched.bench.e2e import RunConfig, policy_configs, wants_draft_loop
from specsched.engine.request import SamplingParams
from specsched.policies.fixed import FixedConfig, FixedPolicy

NON_SPEC = "non-speculative"


@dataclass
class Cell:
    suite: str  # synthetic | real
    spec: EngineSpec
    batch: int
    proposer: str  # label: "synthetic a=0.6", "ngram", "draft (self, 8 layers)"
    acceptance: float | None
    runs: list[RunConfig]  # non-speculative first
    prompts: list[list[int]]  # one pass
    max_new_tokens: int


def _runs(cfg, scorers: list[str], proposers: dict, proposer: str, none) -> list[RunConfig]:
    base = "batch_expansion" if "batch_expansion" in scorers else scorers[0]
    non_spec = RunConfig(NON_SPEC, lambda: FixedPolicy(FixedConfig(k=0, scorer=base)), {"none": none}, "none")
    return [non_spec] + [
        RunConfig(e.label, e.make, proposers, proposer, e.scheduler, e.draft_loop)
        for e in policy_configs(cfg, scorers)
    ]


def synthetic_cells(cfg, graphs_cfg, device: torch.device, dtype: torch.dtype, block_size: int, seed: int):
    """The 7B pair (random weights) at each batch x synthetic acceptance, one cell at a time."""
    from specsched.proposers.draft import DraftModelProposer
    from specsched.proposers.none import NoProposer
    from specsched.proposers.synthetic import SyntheticProposer, attach_oracle
    from specsched.scorers.graph import attach_draft_graphs, build_prefill_runner
    from specsched.scorers.registry import build_scorers

    target = random_model(cfg.target, device, dtype, seed)
    draft = random_model(cfg.draft, device, dtype, seed + 1)
    max_b, max_len = max(cfg.batch), cfg.prompt_len + cfg.max_new_tokens + cfg.max_k + 2
    num_blocks = blocks_for(max_b * cfg.groups, max_len, block_size)
    kv = target.allocate_kv_cache(num_blocks, block_size)
    gcfg = replace(
        graph_config(graphs_cfg, max_b, cfg.max_k, max_len),
        draft_loop=wants_draft_loop(cfg, list(cfg.scorers)),
    )
    scorers = build_scorers(list(cfg.scorers), target, kv, block_size, gcfg)
    draft_prop = DraftModelProposer(draft, draft.allocate_kv_cache(num_blocks, block_size), block_size)
    attach_draft_graphs(draft_prop, gcfg, block_size)
    spec = EngineSpec(target, kv, num_blocks, block_size, scorers, max_b, cfg.max_k, max_len,
                      list(target.cfg.eos_token_ids), None, f"{cfg.target}+{cfg.draft}",
                      prefill_runner=build_prefill_runner(target, kv, block_size, gcfg))  # fmt: skip
    none = NoProposer(device)
    warm_up_spec(spec, {"none": none, "draft": draft_prop})  # as the daemon does before it serves
    for b in cfg.batch:
        prompts = random_prompts(target.cfg.vocab_size, b * cfg.groups, cfg.prompt_len, seed + b)
        ref = make_engine(
            spec, {"none": none}, "none", FixedPolicy(FixedConfig(k=0, scorer=list(scorers)[0]))
        )
        outputs = ref.generate(prompts, SamplingParams(max_tokens=cfg.max_new_tokens, ignore_eos=True))
        for a in cfg.acceptance:
            synth = SyntheticProposer(target, a, block_size, seed, draft=draft_prop)
            attach_oracle(synth, prompts, outputs)
            runs = _runs(cfg, list(scorers), {"none": none, "synthetic": synth}, "synthetic", none)
            yield Cell("synthetic", spec, b, f"synthetic a={a}", a, runs, prompts, cfg.max_new_tokens)


def real_cells(cfg, graphs_cfg, device: torch.device, dtype: torch.dtype, block_size: int, seed: int):
    """A real model with each proposer on real prompts, one cell per (proposer, batch)."""
    from specsched.bench.suites import real_prompt_ids
    from specsched.engine.config import ModelConfig, NgramConfig
    from specsched.models.loader import load_model
    from specsched.proposers.draft import DraftModelProposer
    from specsched.proposers.ngram import NgramProposer
    from specsched.proposers.none import NoProposer
    from specsched.scorers.graph import attach_draft_graphs, build_prefill_runner
    from specsched.scorers.registry import build_scorers

    dtype_name = str(dtype).replace("torch.", "")
    loaded = load_model(ModelConfig(source=cfg.source, device=str(device), dtype=dtype_name, seed=seed))
    model = loaded.model
    prompts, _ = real_prompt_ids(loaded.tokenizer, model.cfg.vocab_size, cfg.num_prompts, seed)
    max_b = max(cfg.batch)
    max_len = min(max(map(len, prompts)) + cfg.max_new_tokens + cfg.max_k + 2, loaded.max_model_len)
    num_blocks = blocks_for(max(max_b, len(prompts)), max_len, block_size)
    kv = model.allocate_kv_cache(num_blocks, block_size)
    gcfg = replace(
        graph_config(graphs_cfg, max_b, cfg.max_k, max_len),
        draft_loop=wants_draft_loop(cfg, list(cfg.scorers)),
    )
    scorers = build_scorers(list(cfg.scorers), model, kv, block_size, gcfg)
    spec = EngineSpec(model, kv, num_blocks, block_size, scorers, max_b, cfg.max_k, max_len,
                      list(loaded.llama_config.eos_token_ids), loaded.tokenizer, loaded.name,
                      prefill_runner=build_prefill_runner(model, kv, block_size, gcfg))  # fmt: skip
    none = NoProposer(device)
    warm_up_spec(spec, {"none": none})
    for name in cfg.proposers:
        if name == "draft":
            layers = min(cfg.draft_layers, model.cfg.num_layers)
            prop = DraftModelProposer(
                model, model.allocate_kv_cache(num_blocks, block_size, layers), block_size, layers
            )
            attach_draft_graphs(prop, gcfg, block_size)
            label = f"draft (self, {layers} layers)"
        elif name == "ngram":
            prop, label = NgramProposer(NgramConfig(), device), "ngram"
        else:
            raise ValueError(f"bench.regret.real.proposers: unknown proposer {name!r}; known: draft, ngram")
        for b in cfg.batch:
            runs = _runs(cfg, list(scorers), {"none": none, name: prop}, name, none)
            yield Cell("real", spec, b, label, None, runs, prompts, cfg.max_new_tokens)
