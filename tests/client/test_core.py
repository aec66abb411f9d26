"""The client's sans-IO core, driven by hand-built reply frames (no socket, no daemon): routing by id,
typed results and errors, lost / abandoned / closed requests, stream assembly."""

from __future__ import annotations

import gc
import logging

import msgpack
import pytest
import zmq

from specsched.client.core import ClientCore, Completion, StreamAssembly, build_generate
from specsched.client.errors import (
    AuthenticationFailed,
    ConnectionLost,
    DuplicateId,
    MessageTooLarge,
    PromptTooLong,
    ServerError,
    SpecschedError,
    UnknownProposer,
)
from specsched.daemon.protocol import (
    Chunk,
    Done,
    Error,
    Generate,
    HealthReply,
    SpecUsage,
    Stats,
    StatsReply,
    Usage,
    decode,
    encode,
)


def gen(rid: str, stream: bool = True) -> Generate:
    return build_generate(stream, None, [1, 2, 3], None, 8, 0.0, 1.0, 0, None, None, None, rid)


def chunk(rid: str, ids: list[int], text: str = "") -> bytes:
    return encode(Chunk(rid, ids, text, proposed=2, accepted=1))


def done(rid: str, reason: str = "length", **kw) -> bytes:
    return encode(Done(rid, reason, Usage(3, 2), SpecUsage(4, 3, 2), **kw))


def drain(core: ClientCore, rid: str) -> list:
    out = []
    while (msg := core.next_reply(rid)) is not None:
        out.append(msg)
    return out


def test_submit_encodes_the_request_and_replies_are_routed_by_id():
    core = ClientCore(1 << 20)
    data = core.submit(gen("a"))
    assert decode(data) == gen("a")  # the exact wire message of the request
    core.submit(gen("b"))
    assert core.next_reply("a") is None  # nothing yet: the caller waits
    for frame in (chunk("b", [7]), chunk("a", [5]), done("b"), chunk("a", [6]), chunk("zz", [9])):
        core.receive(frame)
    assert [m.token_ids for m in drain(core, "a")] == [[5], [6]]
    b = drain(core, "b")
    assert [type(m) for m in b] == [Chunk, Done] and b[0].token_ids == [7]
    assert core.receive(chunk("zz", [9])) is None  # an id that is not pending is dropped
    assert core.receive(chunk("a", [8])) == "a"


def test_unreadable_and_idless_replies_are_dropped_with_a_warning(caplog):
    core = ClientCore(1 << 20)
    core.submit(gen("a"))
    with caplog.at_level(logging.WARNING, logger="specsched.client.sync_client"):
        assert core.receive(b"\xc1 not msgpack") is None
        assert core.receive(encode(Error(None, "bad_message", "x"))) is None
        assert core.receive(encode(StatsReply(id=None))) is None
        assert core.receive(msgpack.packb({"v": 1, "type": "generate", "id": "a", "prompt": "x"})) is None
    assert len(caplog.records) == 4
    assert core.next_reply("a") is None  # none of them reached the request


def test_final_returns_the_expected_reply_and_raises_typed_errors():
    core = ClientCore(1 << 20)
    core.submit(Stats("s"))
    core.receive(encode(StatsReply(id="s", num_running=3)))
    assert core.final("s", core.next_reply("s"), StatsReply).num_running == 3
    assert not core.is_pending("s")

    core.submit(gen("g", stream=False))
    core.receive(encode(Error("g", "prompt_too_long", "generate: 900 tokens")))
    with pytest.raises(PromptTooLong) as info:
        core.final("g", core.next_reply("g"), Done)
    err = info.value
    assert (err.code, err.message, err.request_id) == ("prompt_too_long", "generate: 900 tokens", "g")
    assert not core.is_pending("g")

    core.submit(gen("g", stream=False))  # the id is free again
    core.receive(encode(Error("g", "some_future_code", "?")))
    with pytest.raises(ServerError) as info:
        core.final("g", core.next_reply("g"), Done)
    assert type(info.value) is ServerError and info.value.code == "some_future_code"

    core.submit(Stats("h"))
    core.receive(encode(HealthReply(id="h")))
    with pytest.raises(SpecschedError, match="bad_reply: expected stats_reply for 'h', got health_reply"):
        core.final("h", core.next_reply("h"), StatsReply)


def test_duplicate_too_large_and_closed_requests_are_refused_before_sending():
    core = ClientCore(200)
    core.submit(gen("a"))
    with pytest.raises(DuplicateId):
        core.submit(gen("a"))
    big = build_generate(True, "x" * 300, None, None, 8, 0.0, 1.0, 0, None, None, None, "big")
    with pytest.raises(MessageTooLarge, match="> max_message_bytes 200"):
        core.submit(big)
    assert not core.is_pending("big")  # refused: not waiting for replies
    core.close()
    with pytest.raises(ConnectionLost) as info:
        core.submit(gen("c"))
    assert info.value.code == "closed"


def test_a_dropped_connection_fails_pending_requests_after_their_received_replies():
    core = ClientCore(1 << 20)
    core.submit(gen("a"))
    core.submit(gen("b"))
    core.receive(chunk("a", [5]))
    core.connection_event(zmq.EVENT_DISCONNECTED)
    core.connection_event(zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # the first event names the cause
    core.connection_event(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # reconnected
    core.submit(gen("c"))  # sent after the events: not concerned
    assert core.next_reply("a").token_ids == [5]
    with pytest.raises(ConnectionLost) as info:
        core.next_reply("a")
    assert type(info.value) is ConnectionLost and info.value.code == "connection_lost"
    assert not core.is_pending("a")
    with pytest.raises(ConnectionLost):
        core.next_reply("b")
    assert core.next_reply("c") is None and core.is_pending("c")


def test_a_failed_handshake_raises_authentication_failed():
    core = ClientCore(1 << 20)
    core.submit(gen("a"))
    core.connection_event(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    with pytest.raises(AuthenticationFailed) as info:
        core.next_reply("a")
    assert info.value.code == "auth_failed" and "not allowed" in info.value.message


def test_a_handshake_that_failed_before_the_request_refuses_it_until_one_succeeds():
    """The monitor's event can come before the first request (the client connects at once); the
    request must then fail at once, not wait out its timeout for an event that came already."""
    core = ClientCore(1 << 20)
    core.connection_event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    with pytest.raises(AuthenticationFailed, match="requires CURVE"):
        core.submit(gen("a"))
    assert not core.is_pending("a")  # nothing sent, nothing kept
    core.connection_event(zmq.EVENT_DISCONNECTED)  # the retry's disconnect does not clear it
    with pytest.raises(AuthenticationFailed):
        core.submit(gen("b"))
    core.connection_event(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    core.submit(gen("c"))
    assert core.next_reply("c") is None  # pending, waiting for its replies


def test_an_abandoned_request_is_cancelled_once_and_its_late_replies_are_dropped():
    core = ClientCore(1 << 20)
    core.submit(gen("a"))
    core.receive(chunk("a", [5]))
    assert core.abandon("a") and not core.abandon("a")  # the second call finds nothing pending
    assert core.next_cancel() == "a" and core.next_cancel() is None
    core.submit(gen("a"))  # the id is reused before the old request's last reply came
    assert core.receive(chunk("a", [6])) is None  # still the old request's: dropped
    assert core.receive(done("a", "abort")) is None  # its last reply ends the dropping
    assert core.receive(chunk("a", [7])) == "a"
    assert [m.token_ids for m in drain(core, "a")] == [[7]]


def test_reconnect_fails_every_pending_request_at_once_and_forgets_cancels():
    core = ClientCore(1 << 20)
    core.submit(gen("a"))
    core.submit(gen("b"))
    core.receive(chunk("a", [5]))
    core.abandon("b")
    core.reset()
    assert core.next_cancel() is None  # the old socket's requests are not cancelled on the new one
    with pytest.raises(ConnectionLost):  # replies received before are dropped too
        core.next_reply("a")
    core.submit(gen("a"))  # a fresh start for the id
    assert core.next_reply("a") is None


def test_close_fails_waiting_requests_after_their_received_replies():
    core = ClientCore(1 << 20)
    core.submit(gen("a"))
    core.receive(chunk("a", [5]))
    core.submit(gen("b"))
    core.abandon("b")
    core.close()
    assert core.next_cancel() is None  # nothing is sent once closed
    assert core.next_reply("a").token_ids == [5]
    with pytest.raises(ConnectionLost) as info:
        core.next_reply("a")
    assert info.value.code == "closed"


def test_a_stream_assembles_its_chunks_into_the_completion():
    core = ClientCore(1 << 20)
    core.submit(gen("s"))
    stream = StreamAssembly(core, "s")
    got = [
        stream._feed(decode(f, allowed=("chunk", "done")))
        for f in (chunk("s", [5, 6], "He"), chunk("s", [], "llo"))
    ]
    assert [c.text for c in got] == ["He", "llo"] and stream.completion is None
    assert stream._feed(decode(done("s", "stop"), allowed=("done",))) is None
    assert not core.is_pending("s") and not stream._is_open
    assert stream.completion == Completion("s", "Hello", [5, 6], "stop", Usage(3, 2), SpecUsage(4, 3, 2))


def test_a_stream_raises_the_typed_error_and_ends():
    core = ClientCore(1 << 20)
    core.submit(gen("s"))
    stream = StreamAssembly(core, "s")
    with pytest.raises(UnknownProposer):
        stream._feed(Error("s", "unknown_proposer", "generate.spec.proposer: 'x'"))
    assert not stream._is_open and not core.is_pending("s") and stream.done is None
    core.submit(gen("t"))
    other = StreamAssembly(core, "t")
    with pytest.raises(SpecschedError, match="unexpected stats_reply in the stream of 't'"):
        other._feed(StatsReply(id="t"))


def test_a_stream_dropped_unfinished_is_cancelled_and_a_finished_one_is_not():
    core = ClientCore(1 << 20)
    core.submit(gen("s"))
    stream = StreamAssembly(core, "s")
    stream._feed(Chunk("s", [1], "a"))
    del stream
    gc.collect()
    assert core.next_cancel() == "s" and not core.is_pending("s")
    core.submit(gen("t"))
    finished = StreamAssembly(core, "t")
    finished._feed(Done("t", "length"))
    del finished
    gc.collect()
    assert core.next_cancel() is None


def test_build_generate_checks_the_id_and_converts_plain_dicts():
    msg = build_generate(False, None, None, [{"role": "user", "content": "hi"}], 8, 0.5, 0.9, 4, 7,
                         ["x"], {"max_k": 2}, None, timeout=3.0)  # fmt: skip
    assert len(msg.id) == 32 and msg.stream is False and msg.timeout == 3.0
    assert msg.messages[0].role == "user" and msg.spec.max_k == 2 and msg.spec.proposer is None
    assert decode(encode(msg)) == msg  # what the daemon reads back is what was built
    for bad in ("", "x" * 129, 5):
        with pytest.raises(ValueError, match="id must be a string of 1..128 characters"):
            build_generate(True, "p", None, None, 8, 0.0, 1.0, 0, None, None, None, bad)
