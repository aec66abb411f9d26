"""Speak protocol v1 with nothing but pyzmq and msgpack, as docs/protocol.md describes it (no
specsched import here), against the real daemon."""

from __future__ import annotations

import msgpack
import pytest
import zmq

# The documented reply fields (docs/protocol.md, "Server → client messages").
CHUNK_KEYS = {"v", "type", "id", "token_ids", "text", "proposed", "accepted"}
DONE_KEYS = {"v", "type", "id", "finish_reason", "usage", "spec", "text", "token_ids"}
ERROR_KEYS = {"v", "type", "id", "code", "message"}
HEALTH_KEYS = {"v", "type", "id", "status", "model", "uptime_s"}
STATS_KEYS = {
    "v",
    "type",
    "id",
    "uptime_s",
    "num_waiting",
    "num_running",
    "num_inflight",
    "num_free_blocks",
    "num_total_blocks",
    "tokens_per_s",
    "num_requests_done",
    "num_requests_aborted",
    "num_requests_errored",
    "num_requests_rejected",
    "num_bad_messages",
    "num_log_failures",
    "proposers",
    "scorers",
    "engine",
}


def send(sock: zmq.Socket, obj) -> None:
    sock.send(msgpack.packb(obj))


def recv(sock: zmq.Socket, timeout_s: float = 30.0) -> dict:
    assert sock.poll(timeout_s * 1e3), f"no reply within {timeout_s} s"
    msg = msgpack.unpackb(sock.recv())
    assert msg["v"] == 1
    return msg


def ask(sock: zmq.Socket, obj) -> dict:
    send(sock, obj)
    return recv(sock)


def until_done(sock: zmq.Socket, rid: str) -> tuple[list[dict], dict]:
    chunks = []
    while True:
        msg = recv(sock)
        assert msg["id"] == rid
        if msg["type"] != "chunk":
            return chunks, msg
        assert set(msg) == CHUNK_KEYS
        chunks.append(msg)


def test_health_and_stats_echo_their_id(raw_socket):
    h = ask(raw_socket, {"v": 1, "type": "health", "id": "h1"})
    assert set(h) == HEALTH_KEYS and (h["type"], h["id"], h["status"]) == ("health_reply", "h1", "ok")
    s = ask(raw_socket, {"v": 1, "type": "stats", "id": "s1"})
    assert STATS_KEYS <= set(s) and (s["type"], s["id"]) == ("stats_reply", "s1")  # v1 may add fields
    assert 0 <= s["num_free_blocks"] <= s["num_total_blocks"]
    assert ask(raw_socket, {"v": 1, "type": "health"})["id"] is None


def test_streaming_and_non_streaming_generate(raw_socket):
    req = {"v": 1, "type": "generate", "id": "g1", "prompt_ids": [5, 6, 7, 5, 6, 7], "max_tokens": 6}
    send(raw_socket, req)
    chunks, done = until_done(raw_socket, "g1")
    assert set(done) == DONE_KEYS and done["type"] == "done"
    assert done["finish_reason"] in ("stop", "length") and done["text"] is None and done["token_ids"] is None
    streamed = [t for c in chunks for t in c["token_ids"]]
    assert done["usage"] == {"prompt_tokens": 6, "completion_tokens": len(streamed)}
    assert set(done["spec"]) == {"proposed", "accepted", "steps"}
    assert done["spec"]["proposed"] == sum(c["proposed"] for c in chunks)

    send(raw_socket, {**req, "id": "g2", "stream": False})
    chunks, done = until_done(raw_socket, "g2")
    assert chunks == [] and done["token_ids"] == streamed and done["text"] == ""  # greedy: same tokens


def test_duplicate_id_cancel_and_unknown_id(raw_socket):
    long = {"v": 1, "type": "generate", "id": "d1", "prompt_ids": [9, 8, 7], "max_tokens": 1500}
    send(raw_socket, long)
    send(raw_socket, long)  # the same id while the first is in flight
    first = recv(raw_socket)
    while first["type"] == "chunk":  # chunks of d1 may come first
        first = recv(raw_socket)
    assert first["type"] == "error" and (first["id"], first["code"]) == ("d1", "duplicate_id")
    send(raw_socket, {"v": 1, "type": "cancel", "id": "d1"})
    _, done = until_done(raw_socket, "d1")
    assert (done["type"], done["finish_reason"]) == ("done", "abort")
    err = ask(raw_socket, {"v": 1, "type": "cancel", "id": "d1"})
    assert set(err) == ERROR_KEYS and (err["type"], err["id"], err["code"]) == ("error", "d1", "unknown_id")


@pytest.mark.parametrize(
    "obj,code,field",
    [
        (
            {"v": 1, "type": "generate", "id": "b1", "prompt_ids": [1], "max_tokens": -1},
            "invalid_field",
            "max_tokens",
        ),
        (
            {"v": 1, "type": "generate", "id": "b2", "prompt_ids": [1], "max_tokens": True},
            "invalid_field",
            "max_tokens",
        ),
        (
            {"v": 1, "type": "generate", "id": "b3", "prompt_ids": [1], "colour": "red"},
            "invalid_field",
            "colour",
        ),
        ({"v": 1, "type": "generate", "id": "b4"}, "invalid_field", "prompt"),
        ({"v": 1, "type": "generate", "id": "b5", "prompt_ids": [1] * 513}, "prompt_too_long", ""),
        (
            {"v": 1, "type": "generate", "id": "b6", "prompt_ids": [1], "spec": {"proposer": "x"}},
            "unknown_proposer",
            "ngram",
        ),
        ({"v": 1, "type": "launch", "id": "b7"}, "unknown_type", "launch"),
        ({"v": 2, "type": "health", "id": "b8"}, "bad_message", "v"),
        ([1, "health"], "bad_message", ""),
    ],
)
def test_bad_messages_get_an_error_naming_the_problem(raw_socket, obj, code, field):
    err = ask(raw_socket, obj)
    assert (err["type"], err["code"]) == ("error", code)
    assert field in err["message"]
    assert err["id"] == (obj.get("id") if isinstance(obj, dict) else None)


def test_frames_that_are_not_one_msgpack_map(raw_socket):
    raw_socket.send(b"\xc1 not msgpack")
    assert (recv(raw_socket)["code"], ask(raw_socket, {"v": 1, "type": "health"})["status"]) == (
        "bad_message",
        "ok",
    )
    raw_socket.send_multipart([msgpack.packb({"v": 1, "type": "health"}), b"extra"])
    err = recv(raw_socket)
    assert (err["type"], err["code"], err["id"]) == ("error", "bad_message", None)


def test_too_many_inflight_then_closing_the_socket_aborts_them(tiny_daemon):
    limit = tiny_daemon.options["daemon"]["max_inflight_per_client"]
    ctx = zmq.Context.instance()
    sock, observer = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in (sock, observer):
        s.setsockopt(zmq.LINGER, 0)
        s.connect(tiny_daemon.endpoint)
    try:
        for i in range(limit + 1):
            send(
                sock, {"v": 1, "type": "generate", "id": f"m{i}", "prompt_ids": [4, 5, i], "max_tokens": 1500}
            )
        msg = recv(sock)
        while msg["type"] == "chunk":
            msg = recv(sock)
        assert (msg["type"], msg["id"], msg["code"]) == ("error", f"m{limit}", "too_many_inflight")
        sock.close()  # vanish: the daemon aborts all of them at its next send
        for _ in range(600):
            s = ask(observer, {"v": 1, "type": "stats"})
            if s["num_inflight"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]:
                break
            observer.poll(50)
        assert s["num_inflight"] == 0 and s["num_free_blocks"] == s["num_total_blocks"], s
    finally:
        sock.close()
        observer.close()


def test_oversized_message_is_dropped_by_zmq_and_the_daemon_keeps_serving(tiny_daemon):
    limit = tiny_daemon.options["daemon"]["max_message_bytes"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tiny_daemon.endpoint)
    try:
        assert ask(sock, {"v": 1, "type": "health"})["status"] == "ok"
        send(sock, {"v": 1, "type": "generate", "id": "big", "prompt": "x" * limit})
        assert not sock.poll(500), "an oversized message must get no reply"
        # ZMQ closed that connection; the DEALER reconnects by itself and is served again
        assert ask(sock, {"v": 1, "type": "health", "id": "after"})["id"] == "after"
    finally:
        sock.close()
