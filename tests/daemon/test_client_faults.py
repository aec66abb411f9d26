"""Client-side faults: the daemon dies, restarts or freezes while clients wait (typed errors, no hang,
the client carries on), duplicate request ids, cancel of an unknown id (raw pyzmq)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import msgpack
import pytest
import zmq

from specsched.client.sync_client import AsyncClient, Client, ConnectionLost, DuplicateId, RequestTimeout

LONG = 1500
pytestmark = pytest.mark.slow


def send(sock, obj) -> None:
    sock.send(msgpack.packb(obj))


def recv(sock, timeout_s: float = 30.0) -> dict:
    assert sock.poll(timeout_s * 1e3), f"no reply within {timeout_s} s"
    return msgpack.unpackb(sock.recv())


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def test_daemon_restart_while_clients_wait(start_daemon):
    """kill -9 with a sync stream, a sync generate (another thread) and an async stream waiting: each
    raises ConnectionLost within seconds; while the daemon is down a request times out (typed); once
    it is back on the same port the same clients are served again, and reconnect() starts afresh."""
    d = start_daemon()
    waiting = Client(d.endpoint, timeout_s=60)
    blocked = Client(d.endpoint, timeout_s=60)
    outcome: dict[str, object] = {}

    def blocked_generate() -> None:
        try:
            outcome["result"] = blocked.generate(prompt_ids=[5, 6, 7], max_tokens=LONG)
        except Exception as e:  # noqa: BLE001 -- inspected below
            outcome["error"] = e
        outcome["t"] = time.monotonic()

    async def async_side(ready: threading.Event, killed: threading.Event):
        async with AsyncClient(d.endpoint, timeout_s=60) as c:
            stream = c.stream(prompt_ids=[6, 7, 8], max_tokens=LONG)
            await stream.__anext__()
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, killed.wait)
            with pytest.raises(ConnectionLost):
                async for _ in stream:
                    pass
            return time.monotonic()

    ready, killed = threading.Event(), threading.Event()
    async_result: dict[str, float] = {}
    side = threading.Thread(
        target=lambda: async_result.setdefault("t", asyncio.run(async_side(ready, killed)))
    )
    side.start()
    stream = waiting.stream(prompt_ids=[4, 5, 6], max_tokens=LONG)
    next(stream)
    worker = threading.Thread(target=blocked_generate)
    worker.start()
    assert ready.wait(30)
    time.sleep(0.2)  # the blocked generate is in flight
    t_kill = time.monotonic()
    d.proc.kill()
    d.proc.wait(10)
    killed.set()
    with pytest.raises(ConnectionLost):
        list(stream)
    worker.join(30)
    side.join(30)
    assert isinstance(outcome.get("error"), ConnectionLost), outcome
    assert max(outcome["t"], async_result["t"], time.monotonic()) - t_kill < 20

    with Client(d.endpoint, timeout_s=1.0) as down:  # nobody listens: a typed timeout, not a hang
        with pytest.raises(RequestTimeout):
            down.health()

    back = start_daemon(endpoint=d.endpoint)
    assert waiting.generate(prompt_ids=[1, 2, 3], max_tokens=3).usage.completion_tokens == 3
    assert blocked.health().status == "ok"
    stale = blocked.stream(prompt_ids=[4, 5, 6], max_tokens=LONG)
    next(stale)
    blocked.reconnect()  # a fresh socket: what was pending fails at once, new requests work
    with pytest.raises(ConnectionLost):
        list(stale)
    assert blocked.generate(prompt_ids=[1, 2, 3], max_tokens=3).usage.completion_tokens == 3

    async def async_reconnect():
        async with AsyncClient(back.endpoint, timeout_s=30) as c:
            await c.reconnect()
            return (await c.generate(prompt_ids=[1, 2], max_tokens=2)).usage.completion_tokens

    assert asyncio.run(async_reconnect()) == 2
    waiting.close()
    blocked.close()
    for _ in range(100):  # the request of the socket that reconnect() closed gets aborted
        with Client(back.endpoint, timeout_s=30) as c:
            stats = c.stats()
        if stats.num_inflight == 0:
            break
        time.sleep(0.05)
    assert stats.num_inflight == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_frozen_daemon_gives_a_typed_timeout_and_then_serves_again(start_daemon):
    d = start_daemon()
    with Client(d.endpoint, timeout_s=1.0) as c:
        assert c.health().status == "ok"
        d.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(RequestTimeout) as info:
                c.generate(prompt_ids=[5, 6, 7], max_tokens=4)
            assert isinstance(info.value, TimeoutError) and 1.0 <= time.monotonic() - t0 < 5
        finally:
            d.proc.send_signal(signal.SIGCONT)
        assert c.generate(prompt_ids=[5, 6, 7], max_tokens=4).usage.completion_tokens == 4
    assert d.stop() == 0


def test_duplicate_ids_from_one_client_are_rejected(tiny_daemon):
    a, b = dealer(tiny_daemon.endpoint), dealer(tiny_daemon.endpoint)
    try:
        gen = {"v": 1, "type": "generate", "id": "same", "prompt_ids": [5, 6, 7], "max_tokens": 40}
        send(a, gen)
        send(a, gen)
        send(b, gen)  # another connection may use the same id
        seen: dict[str, list[dict]] = {"a": [], "b": []}
        for name, sock in (("a", a), ("b", b)):
            while not any(m["type"] == "done" for m in seen[name]):
                seen[name].append(recv(sock))
        errors = [m for m in seen["a"] if m["type"] == "error"]
        assert [(m["id"], m["code"]) for m in errors] == [("same", "duplicate_id")]
        assert "generate.id" in errors[0]["message"]
        assert [m["type"] for m in seen["a"]].count("done") == 1  # the first request is unharmed
        assert [m["type"] for m in seen["b"]].count("done") == 1
        assert not any(m["type"] == "error" for m in seen["b"])
        toks_a = [t for m in seen["a"] if m["type"] == "chunk" for t in m["token_ids"]]
        toks_b = [t for m in seen["b"] if m["type"] == "chunk" for t in m["token_ids"]]
        assert toks_a == toks_b and 0 < len(toks_a) <= 40
        assert not a.poll(300)  # nothing more: one done, one error
        send(a, {**gen, "max_tokens": 2, "stream": False})  # reusing it after its done is fine
        assert recv(a)["type"] == "done"
    finally:
        a.close()
        b.close()
    with Client(tiny_daemon.endpoint) as c:  # the library refuses before sending
        s = c.stream(prompt_ids=[5, 6, 7], max_tokens=8, id="x")
        with pytest.raises(DuplicateId):
            c.stream(prompt_ids=[5, 6, 7], max_tokens=8, id="x")
        assert len(list(s)) >= 1


def test_cancel_of_an_unknown_id_gets_an_error(tiny_daemon):
    sock = dealer(tiny_daemon.endpoint)
    try:
        send(sock, {"v": 1, "type": "cancel", "id": "never-sent"})
        err = recv(sock)
        assert (err["type"], err["id"], err["code"]) == ("error", "never-sent", "unknown_id")
        assert "cancel.id" in err["message"]
        send(sock, {"v": 1, "type": "generate", "id": "short", "prompt_ids": [1, 2], "max_tokens": 2})
        while recv(sock)["type"] != "done":
            pass
        send(sock, {"v": 1, "type": "cancel", "id": "short"})  # finished: no longer in flight
        assert recv(sock)["code"] == "unknown_id"
        other = dealer(tiny_daemon.endpoint)
        try:  # another connection's request is unknown here
            send(sock, {"v": 1, "type": "generate", "id": "mine", "prompt_ids": [1, 2], "max_tokens": LONG})
            assert recv(sock)["type"] == "chunk"
            send(other, {"v": 1, "type": "cancel", "id": "mine"})
            assert recv(other)["code"] == "unknown_id"
            send(sock, {"v": 1, "type": "cancel", "id": "mine"})
            while (m := recv(sock))["type"] == "chunk":
                pass
            assert (m["type"], m["finish_reason"]) == ("done", "abort")
        finally:
            other.close()
    finally:
        sock.close()
    with Client(tiny_daemon.endpoint, timeout_s=30) as c:  # the library ignores that error and goes on
        c.cancel("never-sent")
        assert c.generate(prompt_ids=[1, 2], max_tokens=2).usage.completion_tokens == 2
