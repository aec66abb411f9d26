"""The one home of the daemon's step counters: the typed ``stats`` views and the engine's own map agree,
prefill steps count tokens only, and the two tokens/s figures follow their documented windows."""

from __future__ import annotations

import pytest

from specsched.daemon.admission import early_rejection
from specsched.daemon.limits import DaemonConfig
from specsched.daemon.protocol import ErrorCode, Generate, ProposerStats, ScorerStats
from specsched.daemon.stats_reply import engine_counters, proposer_stats, scorer_stats
from specsched.engine import stats as stats_module
from specsched.engine.records import StepRecord, StepRequestRecord
from specsched.engine.stats import EngineStats


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(stats_module.time, "monotonic", c)
    return c


def decode_step(
    step: int, proposer: str, scorer: str, ks: list[int], accepted: list[int], ms: float
) -> StepRecord:
    reqs = [StepRequestRecord(f"r{i}", 10, k, a) for i, (k, a) in enumerate(zip(ks, accepted))]
    return StepRecord(
        step, "decode", 0.0, len(ks), sum(ks) + len(ks), scorer=scorer, proposer=proposer,
        score_ms=ms / 2, total_ms=ms, num_emitted=sum(accepted) + len(ks), requests=reqs,
    )  # fmt: skip


def test_typed_views_and_the_engine_map_count_the_same_decode_steps(clock):
    s = EngineStats(window_s=10.0, started=clock.now)
    s.observe(
        StepRecord(0, "prefill", 0.0, 2, 40, scorer="mqa", proposer="ngram", total_ms=9.0, num_emitted=2)
    )
    s.observe(decode_step(1, "ngram", "mqa", [3, 1], [2, 0], ms=4.0))
    s.observe(decode_step(2, "ngram", "batch_expansion", [2], [2], ms=2.0))
    s.observe(decode_step(3, "draft", "mqa", [0], [0], ms=6.0))
    assert proposer_stats(s) == {"ngram": ProposerStats(6, 4, 4 / 6), "draft": ProposerStats(0, 0, 0.0)}
    assert scorer_stats(s) == {"mqa": ScorerStats(2, 5.0, 2.5), "batch_expansion": ScorerStats(1, 2.0, 1.0)}
    d = s.to_dict()
    assert (d["steps"], d["prefill_steps"], d["tokens_out"]) == (4, 1, 2 + 4 + 3 + 1)
    assert d["acceptance"]["ngram"] == {"proposed": 6, "accepted": 4, "rate": 4 / 6}
    assert d["acceptance"]["draft"]["rate"] is None  # the free-form map says "none proposed" as null
    assert d["scorers"]["mqa"] == {"steps": 2, "mean_score_ms": 2.5}


def test_recent_tokens_per_s_covers_the_window_up_to_now_and_falls_to_zero_when_idle(clock):
    s = EngineStats(window_s=10.0, started=clock.now)
    s.observe(StepRecord(0, "prefill", 0.0, 1, 5, num_emitted=30))
    clock.now += 2.0
    assert s.recent_tokens_per_s() == pytest.approx(30 / 2.0)  # shorter than the window right after start
    clock.now += 2.0
    s.observe(StepRecord(1, "decode", 0.0, 1, 1, num_emitted=10))
    clock.now += 2.0
    assert s.tokens_per_s == pytest.approx(40 / 4.0)  # the engine's figure: from the first to the last step
    assert s.recent_tokens_per_s() == pytest.approx(40 / 6.0)  # the daemon's: over the window up to now
    clock.now += 5.0  # the first step left the window
    assert s.recent_tokens_per_s() == pytest.approx(10 / 10.0)
    clock.now += 10.0
    assert s.recent_tokens_per_s() == 0.0


def test_engine_counters_are_msgpack_safe_whatever_the_engine_reports():
    class WithCallable:
        def stats(self):
            return {1: (object, 2.5), "k": {"n": None}}

    class WithObject:
        stats = EngineStats()

    assert engine_counters(WithCallable()) == {"1": [str(object), 2.5], "k": {"n": None}}
    assert engine_counters(WithObject())["steps"] == 0
    assert engine_counters(object()) == {}


def test_early_rejection_checks_in_the_documented_order():
    cfg = DaemonConfig(max_inflight_per_client=2, max_inflight=5)
    msg = Generate("a", prompt_ids=[1])

    def code(ids=(), inflight=0, queued=0, shutting=False):
        got = early_rejection(msg, set(ids), inflight, queued, 4, cfg, shutting)
        return None if got is None else got[0]

    assert code() is None
    assert code(ids={"a"}, inflight=9, queued=9, shutting=True) == ErrorCode.SHUTTING_DOWN
    assert code(ids={"a", "b"}, inflight=9, queued=9) == ErrorCode.DUPLICATE_ID
    assert code(ids={"b", "c"}, inflight=9) == ErrorCode.TOO_MANY_INFLIGHT
    assert code(inflight=5) == ErrorCode.OVERLOADED
    _, why = early_rejection(msg, set(), 3, 4, 4, cfg, False)
    assert "queue is full (4 waiting" in why


def test_the_snapshot_reads_counts_every_time_and_the_engine_wide_figures_when_due(monkeypatch):
    from specsched.daemon import stats_reply
    from specsched.daemon.stats_reply import SnapshotBuilder
    from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig
    from specsched.engine.engine import Engine
    from specsched.engine.request import Request, SamplingParams

    builds = []
    real = stats_reply.engine_counters
    monkeypatch.setattr(stats_reply, "engine_counters", lambda e: builds.append(1) or real(e))
    engine = Engine(
        EngineConfig(model=ModelConfig(source="tiny", device="cpu"), cache=CacheConfig(num_blocks=64))
    )
    steps, builder = EngineStats(10.0), SnapshotBuilder(refresh_s=0.05)
    counts = {"done": 0, "aborted": 0, "errored": 0, "rejected": 0, "timed_out": 0}
    engine.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=8)))
    first = builder.build(engine, counts, 1, steps, now=100.0)
    assert len(builds) == 1 and first.num_waiting == 1 and first.engine["steps"] == 0
    engine.step()  # the prefill: the request runs now (admission reads num_running: never stale)
    busy = builder.build(engine, counts, 1, steps, now=100.01)
    assert (busy.num_running, busy.num_waiting, busy.num_inflight) == (1, 0, 1)
    assert len(builds) == 1 and busy.engine["steps"] == 0  # the engine-wide figures: not within 50 ms
    assert builder.build(engine, counts, 1, steps, now=100.06).engine["steps"] == 1  # 50 ms passed
    engine.step()
    counts["done"] += 1  # a request finished: a stats right after its done sees its steps
    done = builder.build(engine, counts, 1, steps, now=100.07)
    assert done.engine["steps"] == 2 and done.num_requests_done == 1 and len(builds) == 3
    while engine.has_unfinished:
        engine.step()
    idle = builder.build(engine, counts, 0, steps, now=100.071)  # idle: always current
    assert len(builds) == 4 and idle.engine["steps"] == engine.stats.num_steps
