"""Scorers by their config names (``scorer=...``)."""

from __future__ import annotations

from specsched.scorers.base import Scorer
from specsched.scorers.batch_expansion import BatchExpansionScorer
from specsched.scorers.mqa import MQAScorer

SCORERS: dict[str, type[Scorer]] = {
    "batch_expansion": BatchExpansionScorer,
    "mqa": MQAScorer,
}


def get_scorer_class(name: str) -> type[Scorer]:
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; known: {', '.join(sorted(SCORERS))}")
    return SCORERS[name]


def build_scorers(names: list[str], model, kv_cache, block_size: int) -> dict[str, Scorer]:
    """Instantiate the configured scorers over one model and its KV cache."""
    return {n: get_scorer_class(n)(model, kv_cache, block_size) for n in names}
