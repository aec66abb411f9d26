"""The engine's step timer: one record per step with consistent phase times, and (on CUDA) no sync
point but verification's host read.

CPU: the perf_counter path, and the event path driven by a perf_counter-backed stand-in event (the
same code that reads CUDA events: pool reuse, finish, waits). GPU (marked ``gpu``): real CUDA
events; host/GPU syncs per decode step are counted at the dispatcher (blocking copies between host
and device) and by wrapping ``torch.cuda.synchronize`` / ``Event.synchronize``.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specsched.engine.config import (
    CacheConfig,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from specsched.engine.engine import Engine
from specsched.engine.records import StepRecord
from specsched.engine.request import Request, SamplingParams
from specsched.engine.step_timer import StepTimer

PHASES = ("propose_ms", "score_ms", "verify_ms")


def make_engine(device: str = "cpu", proposer: str = "ngram", k: int = 3, graphs: bool = False) -> Engine:
    """Tiny preset, fixed k; on CUDA graphs the MQA graph scorer (and graph-replayed draft steps)."""
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device=device, dtype="float32", cuda_graphs=graphs),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        spec=SpecConfig(
            proposer=proposer,
            scorers=["batch_expansion", "mqa", "mqa_graph"] if graphs else ["batch_expansion", "mqa"],
            max_k=4,
            draft=DraftConfig(source="self", num_layers=2),
        ),
        policy={"name": "fixed", "k": k, "scorer": "mqa_graph" if graphs else "mqa"},
    )
    return Engine(cfg)


def prompts(seed: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 256) for _ in range(rng.randint(2, 5))] * 12)[: rng.randint(8, 40)]
        for _ in range(n)
    ]


def run_recorded(engine: Engine, seed: int = 0) -> tuple[list[StepRecord], list[float]]:
    """Generate step by step: the records emitted and each step's wall time (ms)."""
    records, walls = [], []
    engine.on_step = records.append
    for i, p in enumerate(prompts(seed)):
        engine.add_request(Request(f"t{i}", p, SamplingParams(max_tokens=20, ignore_eos=True)))
    while engine.has_unfinished:
        n, t0 = len(records), time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t0) * 1e3)
        assert len(records) == n + 1, "every step that ran emits exactly one record"
    return records, walls


def check_records(records: list[StepRecord], walls: list[float], eps_ms: float = 0.0) -> None:
    assert [r.step for r in records] == list(range(len(records)))
    for r, wall in zip(records, walls, strict=True):
        times = [getattr(r, f) for f in PHASES]
        assert all(t >= 0 for t in times), (r.step, times)
        assert sum(times) <= r.total_ms + eps_ms, (r.step, times, r.total_ms)
        assert r.total_ms <= wall
        assert r.score_ms > 0 and r.verify_ms > 0
        if r.kind == "prefill":
            assert r.propose_ms == 0
    assert any(r.kind == "decode" and r.num_proposed for r in records), "the test must speculate"


def test_cpu_records_one_per_step_with_consistent_phase_times():
    engine = make_engine()
    records, walls = run_recorded(engine)
    check_records(records, walls)
    assert not engine.timer.is_events
    decode_phases = {"schedule", "view", "decide", "reserve", "propose", "score", "overlap", "verify",
                     "commit", "record", "observe", "stats"}  # fmt: skip
    for r in records:
        between = r.host_ms.pop("between", None)  # the caller's time before the step: not in it
        assert (between is None) == (r.step == 0) and (between is None or between >= 0)
        phases = set(r.host_ms) - {"other"}
        assert phases == (decode_phases if r.kind == "decode" else {"schedule", "score", "verify", "stats"})
        # the host phases partition the step: they add up to its wall time (total_ms is taken last)
        assert sum(r.host_ms.values()) <= r.total_ms + 1e-6
        assert sum(r.host_ms.values()) >= 0.9 * r.total_ms - 0.05, (r.host_ms, r.total_ms)
        for f in PHASES:  # on the host the timed phases' fields are their host times
            assert abs(getattr(r, f) - r.host_ms.get(f.removesuffix("_ms"), 0.0)) < 1e-6
    decode = [r for r in records if r.kind == "decode"]
    # the cost models are fed the measured times: one observation per decode step (or skipped by a
    # guard: a loaded machine makes some steps stall or launch slowly)
    assert engine.costs.model("score", "mqa").num_updates + engine.costs.num_skipped == len(decode)


class FakeEvent:
    """perf_counter stand-in for ``torch.cuda.Event(enable_timing=True)``; ``query`` is False for
    the first ``num_late`` events asked, as if the GPU had not reached them yet."""

    num_late = 0
    num_synchronize = 0

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        if FakeEvent.num_late:
            FakeEvent.num_late -= 1
            return False
        return True

    def synchronize(self) -> None:
        FakeEvent.num_synchronize += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.t is not None and end.t is not None, "elapsed_time of an event never recorded"
        return (end.t - self.t) * 1e3


def test_event_path_reuses_its_pool_and_fills_the_record_at_finish():
    made = []

    def factory() -> FakeEvent:
        made.append(FakeEvent())
        return made[-1]

    timer = StepTimer("cpu", event_factory=factory)
    assert timer.is_events
    for step in range(3):
        rec = StepRecord(step, "decode", 0.0, 1, 1)
        timer.start_step()
        for field in PHASES:
            with timer.phase(rec, field):
                time.sleep(0.002)
        assert all(getattr(rec, f) == 0.0 for f in PHASES)  # read only at finish
        FakeEvent.num_late = 1 if step == 2 else 0
        timer.finish(rec)
        assert all(getattr(rec, f) >= 2.0 for f in PHASES)
        assert all(abs(getattr(rec, f) - timer.host_ms[f.removesuffix("_ms")]) < 1.0 for f in PHASES)
        assert len(made) == 2 * len(PHASES)  # the pool is allocated once, reused every step
    assert timer.num_waits == 1 and FakeEvent.num_synchronize == 1
    rec = StepRecord(3, "decode", 0.0, 1, 1)
    timer.start_step()
    with timer.phase(rec, "score_ms"):
        pass
    with timer.phase(rec, "score_ms"):  # a phase entered twice in a step adds up
        time.sleep(0.002)
    timer.finish(rec)
    assert rec.score_ms >= 2.0 and rec.propose_ms == 0.0


def test_event_records_are_their_own_host_phase():
    """The record calls (where other threads may take the GIL) go to ``events``: not to the phase,
    not to the gaps (``other``)."""

    class SlowEvent(FakeEvent):
        def record(self) -> None:
            time.sleep(0.003)
            super().record()

    timer = StepTimer("cpu", event_factory=SlowEvent)
    rec = StepRecord(0, "decode", 0.0, 1, 1)
    timer.start_step()
    for field in PHASES:
        with timer.phase(rec, field):
            time.sleep(0.001)
    timer.mark("commit")
    ms = timer.host_ms
    # a start and an end record per phase; the step's first apart (its first release of the GIL)
    assert 3.0 <= ms["first_event"] < 6.0
    assert ms["events"] >= (2 * len(PHASES) - 1) * 3.0
    assert ms.get("other", 0.0) < 1.0 and ms["commit"] < 1.0
    assert all(1.0 <= ms[f.removesuffix("_ms")] < 3.0 for f in PHASES)


def test_engine_with_event_timer_keeps_records_consistent():
    engine = make_engine()
    engine.timer = StepTimer("cpu", event_factory=FakeEvent)
    records, walls = run_recorded(engine, seed=1)
    check_records(records, walls)


# ---- GPU -------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class CountSyncs(TorchFunctionMode):
    """Host/GPU sync points called from Python: reads of CUDA tensors on the host (``tolist``,
    ``item``, ``cpu``, ``numpy``, ``bool``/``int``/``float``, ``.to`` / ``copy_`` to the host) and
    blocking host-to-device copies (``.to`` / ``.cuda`` / ``copy_`` without ``non_blocking``, and
    ``torch.tensor`` / ``as_tensor`` onto CUDA: each a stream sync)."""

    _READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("tensor", "as_tensor") and func in (torch.tensor, torch.as_tensor):
            if torch.device(kwargs.get("device") or "cpu").type == "cuda":
                self.syncs.append(f"torch.{name}(device=cuda)")
        elif args and isinstance(args[0], torch.Tensor):
            src = args[0].device.type
            if name in self._READS and src == "cuda":
                self.syncs.append(f"{name} of a CUDA tensor")
            elif name in ("to", "cuda", "copy_"):
                blocking = not (kwargs.get("non_blocking") or any(a is True for a in args[1:]))
                if name == "copy_":
                    dst, src = src, args[1].device.type
                elif name == "cuda":
                    dst = "cuda"
                else:
                    devs = [
                        a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))
                    ]
                    dst = torch.device(devs[0]).type if devs else src
                if src == "cuda" and dst == "cpu" or src == "cpu" and dst == "cuda" and blocking:
                    self.syncs.append(f"{name} {src}->{dst}{' (blocking)' if blocking else ''}")
        return func(*args, **kwargs)


@gpu
@no_cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("proposer", ["ngram", "ngram-sampled", "draft"])
def test_cuda_decode_step_has_one_sync_point(monkeypatch, proposer, graphs):
    """Greedy (n-gram, self-draft) and sampled (n-gram) decode steps: exactly one host read."""
    temperature = 0.8 if proposer == "ngram-sampled" else 0.0
    engine = make_engine("cuda", proposer.removesuffix("-sampled"), graphs=graphs)
    calls = {"cuda.synchronize": 0, "Event.synchronize": 0}
    real_sync, real_ev_sync = torch.cuda.synchronize, torch.cuda.Event.synchronize

    def sync(*a, **k):
        calls["cuda.synchronize"] += 1
        return real_sync(*a, **k)

    def ev_sync(self):
        calls["Event.synchronize"] += 1
        return real_ev_sync(self)

    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", ev_sync)
    records, per_step = [], []
    engine.on_step = records.append
    for i, p in enumerate(prompts(2)):
        sp = SamplingParams(max_tokens=24, ignore_eos=True, temperature=temperature, seed=i)
        engine.add_request(Request(f"g{i}", p, sp))
    while engine.has_unfinished:
        counter, num_records = CountSyncs(), len(records)
        with counter:
            engine.step()
        if len(records) > num_records and records[-1].kind == "decode":
            per_step.append(counter.syncs)
    decode = [r for r in records if r.kind == "decode"]
    assert decode and sum(r.num_proposed for r in decode) > 0
    print(
        f"CUDA {proposer} ({'graphs' if graphs else 'eager'}): syncs per decode step",
        [len(s) for s in per_step],
    )
    assert all(len(s) == 1 for s in per_step), per_step  # verification's one host read
    assert calls == {"cuda.synchronize": 0, "Event.synchronize": engine.timer.num_waits}
    assert engine.timer.num_waits <= len(records) // 10
    for r in records:  # event times: non-negative, disjoint, inside the step
        times = [getattr(r, f) for f in PHASES]
        assert all(t >= 0 for t in times) and sum(times) <= r.total_ms + 0.05, (r.step, times, r.total_ms)


def test_overlapped_observe_feeds_every_decode_record_once_and_keeps_outputs():
    """CUDA mode (forced here): a decode record is observed during the next decode step, and
    prefill steps, idle calls and flush_observations() drain what is left."""
    base, over = make_engine(), make_engine()
    over.is_overlapped_observe = True
    seen: list[int] = []
    inner = over.costs.observe
    over.costs.observe = lambda rec: (seen.append(rec.step), inner(rec))[1]
    records, _ = run_recorded(over, seed=3)
    want, _ = run_recorded(base, seed=3)
    assert [r.num_emitted for r in records] == [r.num_emitted for r in want]
    decode = [r.step for r in records if r.kind == "decode"]
    assert seen == decode[:-1] and over._unobserved and over._unobserved[0].step == decode[-1]
    assert over.step() == [] and seen == decode  # an idle step flushes
    for engine in (over, base):  # each decode record taught the model once, or was skipped by a guard
        costs = engine.costs  # (a loaded machine makes some launches slow: policies/launch_guard.py)
        assert costs.model("score", "mqa").num_updates + costs.num_skipped == len(decode)


def test_an_adjacent_phase_starts_at_the_previous_phase_s_end_event():
    """``is_adjacent``: no device work between two phases, so the second needs no start record (one
    release of the interpreter lock fewer); its time runs from the first's end event."""
    made: list[FakeEvent] = []
    records: list[int] = []

    class CountingEvent(FakeEvent):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

        def record(self) -> None:
            records.append(1)
            self.t = clock[0]  # the device's clock at the record: advanced by the "work" below

    clock = [0.0]  # seconds; a fake device clock (real sleeps overshoot on a loaded CI machine)

    def work(ms: float) -> None:
        clock[0] += ms / 1e3

    timer = StepTimer("cpu", event_factory=CountingEvent)
    for step in range(2):
        records.clear()
        rec = StepRecord(step, "decode", 0.0, 1, 1)
        timer.start_step()
        work(0.5)  # before the first phase: no phase's
        with timer.phase(rec, "propose_ms"):
            work(1.0)
        with timer.phase(rec, "score_ms", is_adjacent=True):
            work(3.0)
        with timer.phase(rec, "verify_ms", is_adjacent=True):
            work(1.0)
        timer.finish(rec)
        assert len(records) == 4  # propose's start and end, score's end, verify's end
        assert len(made) == 4  # the pool: made once, reused the next step
        # each phase from the previous one's end event to its own: no phase counts another's time
        assert (rec.propose_ms, rec.score_ms, rec.verify_ms) == pytest.approx((1.0, 3.0, 1.0))
        assert "events" in timer.host_ms and "first_event" in timer.host_ms
    # the first phase of a step has no previous one: it records its own start, adjacent or not
    rec = StepRecord(2, "decode", 0.0, 1, 1)
    timer.start_step()
    records.clear()
    with timer.phase(rec, "score_ms", is_adjacent=True):
        work(1.0)
    timer.finish(rec)
    assert len(records) == 2 and rec.score_ms == pytest.approx(1.0)
