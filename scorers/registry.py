"""Scorers by their config names (``scorer=...``)."""

from __future__ import annotations

from specsched.scorers.base import Scorer
from specsched.scorers.batch_expansion import BatchExpansionScorer
from specsched.scorers.mqa import MQAScorer

SCORERS: dict[str, type[Scorer]] = {
    "batch_expansion": BatchExpansionScorer,
    "mqa": MQAScorer,
    "mqa_graph": MQAScorer,  # eager stand-in off CUDA; build_scorers swaps in the graph version
}


def build_scorers(names: list[str], model, kv_cache, block_size: int, graphs=None) -> dict[str, Scorer]:
    """Instantiate the configured scorers over one model and its KV cache; ``batch_expansion`` and
    ``mqa_graph`` run on CUDA graphs when ``graphs`` (a ``GraphConfig``) allows, else eagerly."""
    from specsched.scorers.graph import build_graph_scorers

    return build_graph_scorers(names, model, kv_cache, block_size, graphs)
