"""Scorers by their config names (``scorer=...``) and the one way to build them."""

from __future__ import annotations

import logging

from specsched.models.llama import KVCache, LlamaForCausalLM
from specsched.scorers.base import Scorer
from specsched.scorers.batch_expansion import BatchExpansionScorer
from specsched.scorers.graph import GraphConfig, build_graph_scorers
from specsched.scorers.mqa import MQAScorer

logger = logging.getLogger(__name__)

SCORERS: dict[str, type[Scorer]] = {  # the eager classes
    "batch_expansion": BatchExpansionScorer,
    "mqa": MQAScorer,
    "mqa_graph": MQAScorer,  # eager stand-in off CUDA; build_scorers swaps in the graph version
}
SCORER_NAMES = tuple(SCORERS)


def default_scorer_names(device_type: str) -> list[str]:
    """The scorers the policy chooses among unless the user narrows them: on CUDA both graph scorers
    and the eager MQA one (ragged k outside the graph buckets); elsewhere the eager ones (without
    CUDA, ``mqa_graph`` would only be the eager MQA scorer again)."""
    if device_type == "cuda":
        return ["batch_expansion", "mqa", "mqa_graph"]
    return ["batch_expansion", "mqa"]


def check_scorer_names(names: list[str]) -> None:
    unknown = [n for n in names if n not in SCORER_NAMES]
    if unknown:
        raise ValueError(f"unknown scorer {unknown[0]!r}; known: {', '.join(SCORER_NAMES)}")


def build_scorers(
    names: list[str],
    model: LlamaForCausalLM,
    kv_cache: KVCache,
    block_size: int,
    graphs: GraphConfig | None = None,
) -> dict[str, Scorer]:
    """Instantiate the configured scorers over one model and its KV cache; ``batch_expansion`` and
    ``mqa_graph`` run on CUDA graphs when ``graphs`` allows, else eagerly (``mqa_graph`` then is the
    eager MQA scorer, with one warning)."""
    check_scorer_names(names)
    cfg = graphs or GraphConfig(enabled=False)
    device = model.lm_head.weight.device
    if cfg.uses_graphs(device):
        return build_graph_scorers(names, model, kv_cache, block_size, cfg)
    if "mqa_graph" in names:
        why = "CUDA graphs are disabled" if not cfg.enabled else f"the model is on {device}, not CUDA"
        logger.warning("scorer mqa_graph: %s; it runs as the eager MQA scorer", why)
    return {n: SCORERS[n](model, kv_cache, block_size) for n in names}
