"""The ``stats_reply`` view of the engine's counters: per-proposer acceptance and per-scorer times as
protocol messages, the engine's own counters made msgpack-safe, and the snapshot the engine thread
publishes for the IO thread every loop iteration (:class:`SnapshotBuilder`)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

from specsched.daemon.messages import ProposerStats, ScorerStats, StatsReply
from specsched.engine.graph_report import graph_stats
from specsched.engine.stats import EngineStats

# while the engine is busy, the snapshot's engine-wide figures (tokens/s, per proposer and scorer, the
# engine's counters) are rebuilt at most this often, and whenever a request finished
STATS_REFRESH_S = 0.05


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
    ``to_dict`` in the implementation) and, where it holds CUDA graphs, each runner's stats under
    ``graphs`` (engine/graph_report.py), with values made msgpack-safe."""
    stats = getattr(engine, "stats", None)
    raw = stats() if callable(stats) else stats.to_dict() if stats is not None else {}
    if hasattr(engine, "scorers") and hasattr(engine, "proposers"):
        graphs = graph_stats(engine)  # the graph runners' replays and eager fallbacks (CUDA)
        if graphs:
            raw = {**raw, "graphs": graphs}

    def plain(v):
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)

    return plain(raw)


class SnapshotBuilder:
    """The stats snapshot of one loop iteration. The queue and request counts are read every time (the
    IO thread's admission reads ``num_running`` from the snapshot); the rest, ~40 us of Python a loop
    iteration on the dev CPU with a real daemon (a batch-1 step on the H200 is ~1.4 ms), only when
    :data:`STATS_REFRESH_S` passed since it was last built, when a request finished (``counts``
    changed: a ``stats`` right after a ``done`` sees that request's steps), or when the engine idles."""

    def __init__(self, refresh_s: float = STATS_REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self._built_at = -math.inf
        self._counts: tuple[int, ...] | None = None
        self._parts: dict = {}

    def build(
        self, engine, counts: Mapping[str, int], num_inflight: int, step_stats: EngineStats,
        now: float | None = None,
    ) -> StatsReply:  # fmt: skip
        now = time.monotonic() if now is None else now
        key = tuple(counts.values())
        if key != self._counts or not engine.has_unfinished or now - self._built_at >= self.refresh_s:
            self._parts = {
                "tokens_per_s": step_stats.recent_tokens_per_s(),
                "proposers": proposer_stats(step_stats),
                "scorers": scorer_stats(step_stats),
                "engine": engine_counters(engine),
            }
            self._built_at, self._counts = now, key
        return StatsReply(
            num_waiting=engine.num_waiting,
            num_running=engine.num_running,
            num_inflight=num_inflight,
            num_free_blocks=engine.num_free_blocks,
            num_total_blocks=engine.num_total_blocks,
            num_requests_done=counts["done"],
            num_requests_aborted=counts["aborted"],
            num_requests_errored=counts["errored"],
            num_requests_rejected=counts["rejected"],
            num_requests_timed_out=counts["timed_out"],
            num_preemptions=int(getattr(getattr(engine, "scheduler", None), "num_preemptions", 0)),
            **self._parts,
        )
