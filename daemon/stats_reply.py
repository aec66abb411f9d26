"""The ``stats_reply`` view of the engine's counters: per-proposer acceptance and per-scorer times as
protocol messages, and the engine's own counters made msgpack-safe."""

from __future__ import annotations

from specsched.daemon.messages import ProposerStats, ScorerStats
from specsched.engine.stats import EngineStats


def proposer_stats(stats: EngineStats) -> dict[str, ProposerStats]:
    return {
        p: ProposerStats(n, stats.accepted[p], stats.accepted[p] / n if n else 0.0)
        for p, n in stats.proposed.items()
    }


def scorer_stats(stats: EngineStats) -> dict[str, ScorerStats]:
    return {
        s: ScorerStats(n, stats.scorer_step_ms[s] / n, stats.scorer_ms[s] / n)
        for s, n in stats.scorer_steps.items()
    }


def engine_counters(engine) -> dict:
    """The engine's own counters (``stats()`` in the API notes; an :class:`EngineStats` with
    ``to_dict`` in the implementation), with values made msgpack-safe."""
    stats = getattr(engine, "stats", None)
    raw = stats() if callable(stats) else stats.to_dict() if stats is not None else {}

    def plain(v):
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)

    return plain(raw)
