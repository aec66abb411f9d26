"""Building the engine's parts from its config, and merging per-proposer proposals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specsched.engine.config import EngineConfig
from specsched.models.llama import KVCache, LlamaForCausalLM
from specsched.policies.acceptance import AcceptanceEstimator
from specsched.policies.base import Policy
from specsched.policies.cost_model import CostModels
from specsched.proposers.base import Proposals, Proposer
from specsched.scorers.base import Scorer

if TYPE_CHECKING:
    from specsched.engine.warmup import StartupTimes, WarmupReport
    from specsched.models.cuda_graphs import GraphRunner


@dataclass
class EngineParts:
    model: LlamaForCausalLM
    tokenizer: object | None  # specsched.models.tokenizer.Tokenizer
    kv_cache: KVCache
    num_blocks: int
    proposers: dict[str, Proposer]
    scorers: dict[str, Scorer]
    policy: Policy
    costs: CostModels
    acceptance: AcceptanceEstimator
    model_name: str
    device: torch.device
    max_model_len: int
    eos_token_ids: list[int]
    warmup: WarmupReport | None = None  # what the start-up kernel warm-up built (None: it did not run)
    prefill_runner: GraphRunner | None = None  # prefill chunks on graphs (None: eager prefill)


def size_kv_cache(cfg: EngineConfig, model: LlamaForCausalLM, draft_layers: int) -> int:
    """Number of KV blocks: from config, else from the memory budget (GPU fraction or CPU GiB)."""
    if cfg.cache.num_blocks is not None:
        return cfg.cache.num_blocks
    per_block = model.kv_bytes_per_block(cfg.cache.block_size) + (
        model.kv_bytes_per_block(cfg.cache.block_size, draft_layers) if draft_layers else 0
    )
    dev = model.lm_head.weight.device
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        budget = free * cfg.cache.gpu_memory_fraction
    else:
        budget = cfg.cache.cpu_kv_gb * 2**30
    return max(2, int(budget // per_block))


def build_parts(
    cfg: EngineConfig, policy: Policy | None = None, startup: StartupTimes | None = None
) -> EngineParts:
    """The engine's parts for ``cfg``; ``startup``, when given, gets the milestones from the target's
    weights to the kernel warm-up marked (``Engine(cfg, build_parts(cfg, startup=times))``)."""
    from specsched.engine.settings import load_settings
    from specsched.engine.warmup import prebuild_attention, warm_up_engine
    from specsched.models.loader import load_model
    from specsched.policies.registry import build_policy
    from specsched.proposers.registry import build_proposers
    from specsched.scorers.graph import (
        GraphConfig,
        attach_draft_graphs,
        build_prefill_runner,
        graph_buckets_of,
    )
    from specsched.scorers.registry import build_scorers, default_scorer_names

    mark = startup.mark if startup is not None else (lambda milestone: None)
    loaded = load_model(cfg.model, mark=mark)
    if startup is not None:
        startup.conversion = loaded.conversion
    model = loaded.model
    draft = None
    if cfg.spec.proposer == "draft" and cfg.spec.draft.source != "self":
        from specsched.engine.config import ModelConfig

        draft = load_model(
            ModelConfig(
                source=cfg.spec.draft.source,
                dtype=cfg.model.dtype,
                device=cfg.model.device,
                attn_backend=cfg.model.attn_backend,
                seed=cfg.spec.draft.seed,
                cache_dir=cfg.model.cache_dir,
                pdl=cfg.model.pdl,  # process-wide: the draft's load sets it again
                pdl_trigger=cfg.model.pdl_trigger,
                pdl_prefetch_max_mb=cfg.model.pdl_prefetch_max_mb,
            ),
            with_tokenizer=False,  # the target's tokenizer serves; the draft's would be loaded for nothing
        ).model
        mark("draft")
    draft_layers = 0  # layers of draft KV cache beside the target's (a shared self-draft has none)
    if cfg.spec.proposer == "draft":
        draft_layers = draft.cfg.num_layers if draft is not None else cfg.spec.draft.num_layers
        if draft is None and cfg.spec.draft.shared_kv:
            draft_layers = 0
    max_len = min(cfg.model.max_model_len or model.cfg.max_position, model.cfg.max_position)
    # before the KV cache takes its share of free memory (each worker holds a CUDA context)
    prebuilt = prebuild_attention(cfg, [m for m in (model, draft) if m is not None], max_len,
                                  load_settings().num_compile_workers)  # fmt: skip
    mark("prebuild")
    num_blocks = size_kv_cache(cfg, model, draft_layers)
    kv = model.allocate_kv_cache(num_blocks, cfg.cache.block_size)
    mark("kv_cache")
    graphs = GraphConfig.for_engine(cfg, max_len, enabled=cfg.model.cuda_graphs)
    names = cfg.spec.scorers or default_scorer_names(model.lm_head.weight.device.type)
    scorers = build_scorers(names, model, kv, cfg.cache.block_size, graphs)
    prefill_runner = build_prefill_runner(model, kv, cfg.cache.block_size, graphs)
    proposers = build_proposers(cfg.spec, model, num_blocks, cfg.cache.block_size, draft, target_kv=kv)
    if "draft" in proposers:
        attach_draft_graphs(proposers["draft"], graphs, cfg.cache.block_size)
    mark("graphs")
    parts = EngineParts(
        model=model,
        tokenizer=loaded.tokenizer,
        kv_cache=kv,
        num_blocks=num_blocks,
        proposers=proposers,
        scorers=scorers,
        policy=policy or build_policy(dict(cfg.policy)),
        costs=CostModels(
            graph_buckets_of(scorers),
            device=model.lm_head.weight.device.type,
            bucket_bias=cfg.spec.graph_residual,
        ),
        acceptance=AcceptanceEstimator(),
        model_name=loaded.name,
        device=model.lm_head.weight.device,
        max_model_len=max_len,
        eos_token_ids=list(model.cfg.eos_token_ids),
        prefill_runner=prefill_runner,
    )
    parts.warmup = warm_up_engine(cfg, parts, prebuilt)
    mark("warmup")
    return parts


def merge_proposals(
    parts: list[tuple[list[int], Proposals]], batch_size: int, vocab: int, device: torch.device
) -> Proposals:
    """Merge proposals made for subsets of the batch (``parts``: request indices, their proposals)
    back into batch order. Draft probs, when any part has them, become ``[N, vocab]`` with one-hot
    rows for deterministic proposers."""
    if len(parts) == 1 and parts[0][0] == list(range(batch_size)):
        return parts[0][1]
    drafts: list[list[int]] = [[] for _ in range(batch_size)]
    probs: list[torch.Tensor | None] = [None] * batch_size
    for idx, p in parts:
        flat, cu = p.draft_tokens.tolist(), p.cu_num_draft.tolist()
        for j, i in enumerate(idx):
            drafts[i] = flat[cu[j] : cu[j + 1]]
            if p.draft_probs is not None:
                probs[i] = p.draft_probs[cu[j] : cu[j + 1]]
    out = Proposals.from_lists(drafts, device)
    out.is_synthetic = any(p.is_synthetic for _, p in parts)
    if any(q is not None for q in probs):
        rows = [
            q
            if q is not None
            else torch.nn.functional.one_hot(torch.tensor(d, dtype=torch.int64, device=device), vocab).float()
            for q, d in zip(probs, drafts)
        ]
        out.draft_probs = torch.cat(rows) if out.num_tokens else None
    return out
