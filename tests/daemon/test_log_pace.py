"""``log.pace=step``: the decision log's writer takes its records when the engine waits for the device
(``LogWriter.nudge``), not as each is enqueued; durability and flushes are kept."""

from __future__ import annotations

import random
import time

import pytest
import torch

from specsched.client.sync_client import Client
from specsched.daemon.log import LogConfig, LogWriter
from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.request import SamplingParams

from .test_log import count, make_record, request_row, wait_settled


def paced(path, num_steps: int = 0, seed: int = 0, **kw) -> LogWriter:
    """A started ``log.pace=step`` writer with ``num_steps`` step records enqueued."""
    w = LogWriter(LogConfig(path=str(path), pace="step", **kw))
    w.start_run({}, model="m", device="cpu", version="v")
    rng = random.Random(seed)
    for i in range(num_steps):
        w.write_step(make_record(i, rng))
    return w


def test_records_wait_for_a_nudge_then_a_durable_request_commits(tmp_path):
    path = tmp_path / "log.sqlite"
    w = paced(path, num_steps=3, seed=3, flush_interval_s=30.0)
    seq = request_row(w, "a")
    time.sleep(0.3)
    assert w.settled_seq == 0 and count(path, "requests") == 0  # nobody nudged: nothing taken
    w.nudge()
    wait_settled(w, seq, timeout_s=5.0)
    assert (count(path, "steps"), count(path, "requests")) == (3, 1)
    w.close()


def test_steps_alone_wait_for_the_flush_interval_and_flush_needs_no_nudge(tmp_path):
    path = tmp_path / "log.sqlite"
    w = paced(path, num_steps=5, seed=4, flush_interval_s=30.0)
    w.nudge()
    time.sleep(0.3)
    assert w.settled_seq == 0  # taken at the nudge, but no request waits: not written yet
    assert w.flush()  # a control wakes the writer by itself
    assert count(path, "steps") == 5 and w.settled_seq == 5
    w.close()


def test_without_nudges_the_flush_interval_still_writes(tmp_path):
    path = tmp_path / "log.sqlite"
    w = paced(path, flush_interval_s=0.2)
    seq = w.write_step(make_record(0, random.Random(5)))
    wait_settled(w, seq, timeout_s=5.0)
    assert count(path, "steps") == 1
    w.close()


def test_nudge_is_a_no_op_when_the_log_takes_each_record(tmp_path):
    w = LogWriter(LogConfig(path=str(tmp_path / "log.sqlite"), flush_interval_s=30.0, pace="record"))
    w.nudge()
    assert not w._nudge.is_set()
    with pytest.raises(ValueError, match="log.pace must be record or step"):
        LogConfig(path="x.sqlite", pace="each")
    w.close()


def test_engine_calls_on_device_wait_once_per_step_before_its_host_read(monkeypatch):
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64),
        spec=SpecConfig(proposer="ngram", max_k=3),
    )
    engine = Engine(cfg)
    events: list[str] = []
    engine.on_device_wait = lambda: events.append("wait")
    engine.on_step = lambda rec: events.append(rec.kind)
    real = torch.Tensor.tolist

    def tolist(t):  # the host reads of the device's results (verification reads the tokens this way)
        events.append("read")
        return real(t)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    engine.generate([[5, 6, 7, 8] * 4, [9, 10, 11] * 5], SamplingParams(max_tokens=6, ignore_eos=True))
    steps = [e for e in events if e not in ("wait", "read")]
    assert steps and "decode" in steps and "prefill" in steps
    # every step waited once, before its first read and its record: wait, read.., kind, wait, ...
    per_step = "|".join(events).replace("|read", "").split("|")
    assert per_step == [x for kind in steps for x in ("wait", kind)]
    assert "|".join(events).count("wait|read") == len(steps)  # no read before a step's wait


def test_daemon_with_a_step_paced_durable_log_serves_and_commits(start_daemon):
    d = start_daemon(log_db=True, log={"pace": "step", "flush_interval_s": 30.0})
    t0 = time.monotonic()
    with Client(d.endpoint, timeout_s=60) as c:
        outs = [c.generate(prompt_ids=[5, 6, 7, 5, 6, 7, 5 + i], max_tokens=6) for i in range(3)]
    assert all(len(o.token_ids) == 6 for o in outs)
    assert time.monotonic() - t0 < 10.0  # not held for the 30 s flush interval
    # durable: each done left only once its request row was committed (30 s flush interval: the
    # nudges at the device waits and at idle are what wrote them)
    assert count(d.log_path, "requests") == 3 and count(d.log_path, "steps") > 0
    d.stop()
