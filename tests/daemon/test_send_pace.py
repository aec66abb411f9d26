"""``daemon.send_pace=step``: a loop iteration's replies are posted at once but the IO thread is woken
for them at the engine's next device wait (its verification read), or at the next flush when no step
waited since, or at once when the engine idles; clients see the same replies in the same order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specsched.daemon.limits import DaemonConfig
from specsched.daemon.messages import Chunk
from specsched.daemon.serving import Serving


class FakeEngine:
    """What Serving reads of the engine for pacing: ``has_unfinished`` and the device-wait hook."""

    def __init__(self) -> None:
        self.has_unfinished = True
        self.on_device_wait = None


def serving(pace: str, log=None) -> tuple[Serving, FakeEngine, list, list]:
    engine, posts, wakes = FakeEngine(), [], []
    cfg = SimpleNamespace(send_pace=pace, stats_window_s=10.0, idle_sleep_ms=1.0)
    srv = Serving(engine, cfg, posts.append, lambda: wakes.append(len(posts)), log)
    return srv, engine, posts, wakes


def chunk(i: int) -> Chunk:
    return Chunk(f"r{i}", [i], "", 0, 0)


def test_paced_replies_wake_the_io_thread_at_the_next_device_wait():
    srv, engine, posts, wakes = serving("step")
    assert engine.on_device_wait is not None
    srv.send(b"c", chunk(0))
    srv.flush()
    assert len(posts) == 1 and wakes == []  # posted, not woken: a step follows
    engine.on_device_wait()
    assert wakes == [1]
    engine.on_device_wait()  # nothing new posted: no second wake
    srv.flush()
    assert wakes == [1]


def test_a_wake_due_since_the_last_flush_goes_at_the_next_one():
    srv, engine, posts, wakes = serving("step")
    srv.send(b"c", chunk(0))
    srv.flush()
    srv.flush()  # no device wait in between (a loop iteration without a step): wake now
    assert wakes == [1]
    srv.send(b"c", chunk(1))
    srv.flush()
    srv.send(b"c", chunk(2))
    srv.flush()  # the first still due: both go with this wake
    assert wakes == [1, 3] and len(posts) == 3


def test_an_idle_engine_or_a_shutdown_sends_at_once():
    srv, engine, posts, wakes = serving("step")
    engine.has_unfinished = False
    srv.send(b"c", chunk(0))
    srv.flush()
    assert wakes == [1]
    engine.has_unfinished = True
    srv._deadline = 0.0  # shutting down
    srv.send(b"c", chunk(1))
    srv.flush()
    assert wakes == [1, 2]


def test_loop_pace_wakes_at_every_flush_and_hooks_nothing():
    srv, engine, posts, wakes = serving("loop")
    assert engine.on_device_wait is None
    for i in range(3):
        srv.send(b"c", chunk(i))
        srv.flush()
    assert wakes == [1, 2, 3]


def test_the_device_wait_also_nudges_a_step_paced_log():
    nudges = []
    log = SimpleNamespace(is_paced=True, is_durable=False, nudge=lambda: nudges.append(1))
    srv, engine, posts, wakes = serving("step", log)
    srv.send(b"c", chunk(0))
    srv.flush()
    engine.on_device_wait()
    assert wakes == [1] and nudges == [1]


def test_send_pace_is_validated():
    with pytest.raises(ValueError, match="daemon.send_pace must be loop or step"):
        DaemonConfig(send_pace="often")


@pytest.mark.parametrize("log", [None, {"pace": "step"}], ids=["no log", "step-paced durable log"])
def test_daemon_with_paced_sends_streams_every_request_in_order(start_daemon, stream_vs_generate, log):
    d = start_daemon(daemon={"send_pace": "step"}, log_db=log is not None, log=log)
    stream_vs_generate(d.endpoint, [[5, 6, 7, 5, 6, 7, 8 + i] for i in range(6)])
    d.stop()


@pytest.mark.parametrize("pace", ["loop", "step"])
def test_the_io_thread_drains_posted_replies_on_a_request_only_when_unpaced(pace, tmp_path):
    """A reply posted to the outbox without a wake: an unpaced IO thread sends it as soon as anything
    wakes it (a client's request: the reply comes before that request's answer); a paced one holds it
    until a wake or its poll times out (the request's answer comes first)."""
    import msgpack
    import zmq

    from specsched.daemon.server import DaemonConfig, Server
    from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig
    from specsched.engine.engine import Engine

    engine = Engine(
        EngineConfig(model=ModelConfig(source="tiny", device="cpu"), cache=CacheConfig(num_blocks=64))
    )
    srv = Server(
        engine, DaemonConfig(endpoint="tcp://127.0.0.1:0", shutdown_grace_s=0.0, send_pace=pace), None
    )
    srv.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"paced-client")
    sock.connect(srv.bound_endpoint)
    try:
        sock.send(msgpack.packb({"v": 1, "type": "health", "id": "h0"}))
        assert sock.poll(30_000) and msgpack.unpackb(sock.recv())["id"] == "h0"  # connected, routable
        want = ["r7", "h1"] if pace == "loop" else ["h1", "r7"]
        for _ in range(3):  # paced: the IO thread's 100 ms poll may time out between the two
            srv._outbox.put([(b"paced-client", chunk(7))])  # posted, nobody woken
            sock.send(msgpack.packb({"v": 1, "type": "health", "id": "h1"}))
            got = []
            for _ in range(2):
                assert sock.poll(30_000)
                got.append(msgpack.unpackb(sock.recv())["id"])
            if got == want:
                break
        assert got == want
    finally:
        sock.close(0)
        ctx.term()
        srv.request_shutdown()
        assert srv.join(timeout=30)
        srv.close()
