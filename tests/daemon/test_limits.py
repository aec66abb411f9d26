"""Backpressure and limits, each against a real daemon configured with it (docs/operations.md):
in flight per client and in all, the queue, prompt and output length, message size, deadlines."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from specsched.client.sync_client import (
    Client,
    ConnectionLost,
    InvalidField,
    MessageTooLarge,
    PromptTooLong,
)

LONG = 1500  # max_tokens of requests that are cancelled or time out long before they could finish
LIMITS = dict(
    max_inflight=6,
    max_inflight_per_client=4,
    max_prompt_tokens=64,
    max_output_tokens=1600,
    max_message_bytes=16 * 1024,
)


def send(sock, obj) -> None:
    sock.send(msgpack.packb(obj))


def recv(sock, timeout_s: float = 30.0) -> dict:
    assert sock.poll(timeout_s * 1e3), f"no reply within {timeout_s} s"
    return msgpack.unpackb(sock.recv())


def gen(rid: str, **kw) -> dict:
    return {"v": 1, "type": "generate", "id": rid, "prompt_ids": [5, 6, 7, 5, 6, 7], "max_tokens": LONG, **kw}


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def finals(sock, ids: set[str], timeout_s: float = 30.0) -> dict[str, dict]:
    """Read until every id in ``ids`` has its done / error; returns them by id (``_t``: when each came)."""
    out: dict[str, dict] = {}
    while set(out) != ids:
        msg = recv(sock, timeout_s)
        msg["_t"] = time.monotonic()
        if msg["type"] in ("done", "error"):
            assert msg["id"] not in out, f"a second final message for {msg['id']}"
            out[msg["id"]] = msg
    return out


def wait_idle(endpoint: str) -> object:
    with Client(endpoint, timeout_s=30) as c:
        for _ in range(600):
            s = c.stats()
            if s.num_inflight == 0 and s.num_waiting == 0 and s.num_running == 0:
                return s
            time.sleep(0.05)
    raise AssertionError(f"daemon still busy: {s}")


@pytest.fixture(scope="module")
def limited(start_daemon):
    return start_daemon(daemon=LIMITS)


def test_max_inflight_per_client_and_in_all(limited):
    a, b, c = (dealer(limited.endpoint) for _ in range(3))
    try:
        for i in range(5):
            send(a, gen(f"a{i}"))
        err = recv(a)  # the 5th: rejected at once, while the four run
        assert (err["type"], err["id"], err["code"]) == ("error", "a4", "too_many_inflight")
        assert "max_inflight_per_client" in err["message"]
        for i in range(3):
            send(b, gen(f"b{i}"))
        # 4 + 2 = max_inflight: b's third is rejected, whoever's it is
        err = next(m for m in iter(lambda: recv(b), None) if m["type"] == "error")
        assert (err["id"], err["code"]) == ("b2", "overloaded") and "max_inflight" in err["message"]
        send(c, gen("c0"))
        assert (recv(c)["code"]) == "overloaded"
        for i in range(4):
            send(a, {"v": 1, "type": "cancel", "id": f"a{i}"})
        assert {m["finish_reason"] for m in finals(a, {f"a{i}" for i in range(4)}).values()} == {"abort"}
        send(c, gen("c1", max_tokens=3))  # room again
        assert finals(c, {"c1"})["c1"]["type"] == "done"
        for i in range(2):
            send(b, {"v": 1, "type": "cancel", "id": f"b{i}"})
        finals(b, {"b0", "b1"})
    finally:
        for s in (a, b, c):
            s.close()
    s = wait_idle(limited.endpoint)
    assert s.num_requests_rejected >= 3 and s.num_free_blocks == s.num_total_blocks


def test_max_prompt_tokens_and_max_output_tokens(limited):
    with Client(limited.endpoint, timeout_s=30) as c:
        assert c.generate(prompt_ids=[7] * 64, max_tokens=2).usage.prompt_tokens == 64
        with pytest.raises(PromptTooLong, match="65 tokens.*at most 64"):
            c.generate(prompt_ids=[7] * 65, max_tokens=2)
        with pytest.raises(InvalidField, match=r"generate\.max_tokens.*max_output_tokens.*1601"):
            c.generate(prompt_ids=[7, 8], max_tokens=1601)
        stream = c.stream(prompt_ids=[7, 8], max_tokens=1600)  # at the limit: accepted
        next(stream)
        stream.close()


def test_oversize_message_is_dropped_and_the_connection_closed(limited):
    """What a client sees (docs/protocol.md): no reply, a disconnect, its in-flight requests aborted;
    the socket reconnects by itself and is served again."""
    limit = LIMITS["max_message_bytes"]
    aborted = wait_idle(limited.endpoint).num_requests_aborted  # the previous test's cancel is counted
    sock = dealer(limited.endpoint)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        send(sock, gen("running"))
        assert recv(sock)["type"] == "chunk"
        send(sock, gen("huge", prompt_ids=[200] * limit))  # 2 bytes per id: twice the limit
        assert monitor.poll(5000), "ZeroMQ should close the connection of an oversized message"
        while sock.poll(500):  # chunks of "running" sent before the drop may still arrive; nothing else
            msg = msgpack.unpackb(sock.recv())
            assert msg["id"] == "running" and msg["type"] == "chunk", msg
        send(sock, {"v": 1, "type": "health", "id": "after"})
        assert recv(sock)["id"] == "after"
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
    s = wait_idle(limited.endpoint)
    assert s.num_requests_aborted == aborted + 1 and s.num_free_blocks == s.num_total_blocks

    with Client(limited.endpoint, timeout_s=30, max_message_bytes=limit) as c:
        with pytest.raises(MessageTooLarge, match="max_message_bytes"):  # checked before sending
            c.generate(prompt_ids=[200] * limit)
        assert c.generate(prompt_ids=[1, 2], max_tokens=2).usage.completion_tokens == 2
    with Client(limited.endpoint, timeout_s=30, max_message_bytes=4 * limit) as c:  # misconfigured
        stream = c.stream(prompt_ids=[5, 6, 7], max_tokens=LONG)
        next(stream)
        c.stream(prompt_ids=[200] * limit)
        with pytest.raises(ConnectionLost):
            list(stream)
        assert c.generate(prompt_ids=[1, 2], max_tokens=2).usage.completion_tokens == 2


def test_request_timeout_ends_the_request_with_finish_reason_timeout(limited):
    with Client(limited.endpoint, timeout_s=30) as c:
        before = c.stats().num_requests_timed_out
        t0 = time.monotonic()
        stream = c.stream(prompt_ids=[5, 6, 7], max_tokens=LONG, timeout=0.3)
        chunks = list(stream)
        elapsed = time.monotonic() - t0
        assert stream.done.finish_reason == "timeout" and 0.3 <= elapsed < 5.0
        n = stream.done.usage.completion_tokens
        assert 0 < n < LONG and n == sum(len(ch.token_ids) for ch in chunks)
        # a deadline the request beats does nothing
        assert c.generate(prompt_ids=[5, 6, 7], max_tokens=3, timeout=60).finish_reason == "length"
        for bad in (0, -1, float("inf"), float("nan"), 604_801):
            with pytest.raises(InvalidField, match=r"generate\.timeout"):
                c.generate(prompt_ids=[5, 6], timeout=bad)
    s = wait_idle(limited.endpoint)
    assert s.num_requests_timed_out == before + 1 and s.num_free_blocks == s.num_total_blocks


def test_full_queue_answers_overloaded_at_once_and_the_default_deadline_ends_queued_requests(start_daemon):
    """One request runs at a time and three may wait: of a burst of ten, the rest get ``overloaded``
    before anything finishes. ``daemon.request_timeout_s`` then ends running and queued ones alike."""
    d = start_daemon(max_num_seqs=1, scheduler={"max_queue": 3}, daemon={"request_timeout_s": 0.5})
    sock = dealer(d.endpoint)
    try:
        t0 = time.monotonic()
        for i in range(10):
            send(sock, gen(f"q{i}", stream=False))
        got = finals(sock, {f"q{i}" for i in range(10)})
    finally:
        sock.close()
    overloaded = [m for m in got.values() if m["type"] == "error"]
    accepted = [m for m in got.values() if m["type"] == "done"]
    assert {m["code"] for m in overloaded} == {"overloaded"} and "max_queue" in overloaded[0]["message"]
    assert 3 <= len(accepted) <= 1 + 3 and len(overloaded) == 10 - len(accepted)
    assert {m["finish_reason"] for m in accepted} == {"timeout"}
    assert any(m["usage"]["completion_tokens"] == 0 for m in accepted)  # ended while queued
    assert max(m["_t"] for m in overloaded) < min(m["_t"] for m in accepted)  # at once: before any done
    assert max(m["_t"] for m in overloaded) - t0 < 1.0 and time.monotonic() - t0 < 10
    s = wait_idle(d.endpoint)
    assert s.num_requests_timed_out == len(accepted) and s.num_requests_rejected >= len(overloaded)
    assert s.num_free_blocks == s.num_total_blocks
