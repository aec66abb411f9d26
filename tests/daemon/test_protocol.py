"""Protocol v1 codec: round trips, documented defaults, and one error (code + named field) per kind of
bad input. No sockets here: see test_raw_zmq.py / test_client_server.py for the daemon."""

from __future__ import annotations

import math
import re
from dataclasses import fields
from pathlib import Path

import msgpack
import pytest

from specsched.daemon.protocol import (
    SERVER_TYPES,
    Cancel,
    ChatMessage,
    Chunk,
    Done,
    Error,
    ErrorCode,
    Generate,
    Health,
    HealthReply,
    ProposerStats,
    ProtocolError,
    ScorerStats,
    SpecOptions,
    SpecUsage,
    StartupStats,
    Stats,
    StatsReply,
    Usage,
    decode,
    encode,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def pack(**fields) -> bytes:
    return msgpack.packb({"v": 1, **fields})


def gen(**fields) -> bytes:
    return pack(**{"type": "generate", "id": "r1", "prompt_ids": [1, 2, 3], **fields})


CLIENT_MESSAGES = [
    Generate("a", prompt="hello"),
    Generate(
        "b",
        prompt_ids=[0, 5, 2**31 - 1],
        max_tokens=3,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=2**63 - 1,
        stop=["\n\n", "END"],
        stream=False,
        spec=SpecOptions(max_k=0, proposer="ngram"),
    ),  # fmt: skip
    Generate("c", messages=[ChatMessage("system", ""), ChatMessage("user", "hi ü 🚀")]),
    Cancel("a"),
    Stats(),
    Stats("s1"),
    Health(),
    Health("h" * 128),
]
SERVER_MESSAGES = [
    Chunk("a", [1, 2], "he", proposed=3, accepted=1),
    Chunk("a", [], "llo"),
    Done("a", "stop", Usage(3, 2), SpecUsage(3, 1, 2)),
    Done("b", "length", Usage(3, 3), SpecUsage(), text="abc", token_ids=[1, 2, 3]),
    Error(None, "bad_message", "frame is not msgpack"),
    Error("a", "invalid_field", "generate.max_tokens: ..."),
    StatsReply(
        "s",
        1.5,
        1,
        2,
        3,
        10,
        20,
        12.5,
        4,
        5,
        6,
        7,
        8,
        9,
        {"ngram": ProposerStats(10, 4, 0.4)},
        {"mqa": ScorerStats(3, 2.5, 1.5)},
        {"steps": 3, "nested": {"x": [1, 2]}},
    ),  # fmt: skip
    StatsReply("t", startup=StartupStats("proc", "hit", imports_s=1.5, weights_s=2.25, listening_s=4.0)),
    HealthReply("h", "ok", "tiny", 3.25),
]


@pytest.mark.parametrize("msg", CLIENT_MESSAGES, ids=lambda m: m.TYPE)
def test_client_messages_round_trip(msg):
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize("msg", SERVER_MESSAGES, ids=lambda m: m.TYPE)
def test_server_messages_round_trip(msg):
    assert decode(encode(msg), allowed=SERVER_TYPES) == msg


def test_every_message_carries_version_and_type():
    for msg in CLIENT_MESSAGES + SERVER_MESSAGES:
        raw = msgpack.unpackb(encode(msg))
        assert raw["v"] == 1 and raw["type"] == msg.TYPE


def test_generate_defaults_are_the_documented_ones():
    msg = decode(pack(type="generate", id="x", prompt="hi"))
    assert msg == Generate("x", prompt="hi")
    assert (msg.max_tokens, msg.temperature, msg.top_p, msg.top_k, msg.seed) == (64, 0.0, 1.0, 0, None)
    assert (msg.stop, msg.stream, msg.spec) == ([], True, SpecOptions(None, None))
    # nil counts as absent for the optional fields and the prompt alternatives
    msg = decode(gen(seed=None, prompt=None, messages=None, spec={"max_k": None, "proposer": None}))
    assert msg.seed is None and msg.prompt_ids == [1, 2, 3] and msg.spec == SpecOptions()


def test_encode_omits_the_absent_prompt_alternatives():
    raw = msgpack.unpackb(encode(Generate("a", prompt_ids=[1])))
    assert "prompt" not in raw and "messages" not in raw and raw["prompt_ids"] == [1]


def test_integer_valued_floats_are_accepted_and_converted():
    msg = decode(gen(temperature=1, top_p=1))
    assert msg.temperature == 1.0 and isinstance(msg.temperature, float)


BAD = [
    # (frame, code, text the message must contain)
    (b"\xc1", "bad_message", "msgpack"),
    (b"", "bad_message", "msgpack"),
    (msgpack.packb({"v": 1, "type": "health"}) + b"\x00", "bad_message", "msgpack"),
    (msgpack.packb([1, "health"]), "bad_message", "map"),
    (msgpack.packb("health"), "bad_message", "map"),
    (msgpack.packb({"type": "health"}), "bad_message", "v"),
    (msgpack.packb({"v": 2, "type": "health"}), "bad_message", "v"),
    (msgpack.packb({"v": True, "type": "health"}), "bad_message", "v"),
    (msgpack.packb({"v": 1.0, "type": "health"}), "bad_message", "v"),
    (msgpack.packb({1: 1, "v": 1}), "bad_message", "key"),
    (pack(), "invalid_field", "type"),
    (pack(type=7), "invalid_field", "type"),
    (pack(type="chunk", id="a", token_ids=[], text=""), "unknown_type", "chunk"),
    (pack(type="Generate"), "unknown_type", "Generate"),
    (pack(type="health", extra=1), "invalid_field", "health.extra"),
    (pack(type="health", id=""), "invalid_field", "health.id"),
    (pack(type="stats", id=5), "invalid_field", "stats.id"),
    (pack(type="cancel"), "invalid_field", "cancel.id"),
    (pack(type="cancel", id="x" * 129), "invalid_field", "cancel.id"),
    (pack(type="cancel", id=b"abc"), "invalid_field", "cancel.id"),
    (pack(type="generate", prompt="hi"), "invalid_field", "generate.id"),
    (pack(type="generate", id="x"), "invalid_field", "exactly one of"),
    (gen(prompt="hi"), "invalid_field", "exactly one of"),
    (gen(prompt_ids=None, prompt=""), "invalid_field", "generate.prompt"),
    (gen(prompt_ids=[]), "invalid_field", "generate.prompt_ids"),
    (gen(prompt_ids=[1, -1]), "invalid_field", "generate.prompt_ids[1]"),
    (gen(prompt_ids=[1, 2**31]), "invalid_field", "generate.prompt_ids[1]"),
    (gen(prompt_ids=[1, True]), "invalid_field", "generate.prompt_ids[1]"),
    (gen(prompt_ids=[1, 2.0]), "invalid_field", "generate.prompt_ids[1]"),
    (gen(prompt_ids="123"), "invalid_field", "generate.prompt_ids"),
    (gen(prompt_ids=None, messages=[]), "invalid_field", "generate.messages"),
    (gen(prompt_ids=None, messages=[{"role": "user"}]), "invalid_field", "generate.messages[0].content"),
    (
        gen(prompt_ids=None, messages=[{"role": "bot", "content": ""}]),
        "invalid_field",
        "generate.messages[0].role",
    ),
    (
        gen(prompt_ids=None, messages=[{"role": "user", "content": "", "name": "x"}]),
        "invalid_field",
        "generate.messages[0].name",
    ),  # fmt: skip
    (gen(prompt_ids=None, messages=["hi"]), "invalid_field", "generate.messages[0]"),
    (gen(max_tokens=0), "invalid_field", "generate.max_tokens"),
    (gen(max_tokens=-5), "invalid_field", "generate.max_tokens"),
    (gen(max_tokens=True), "invalid_field", "generate.max_tokens"),
    (gen(max_tokens=10.0), "invalid_field", "generate.max_tokens"),
    (gen(max_tokens="10"), "invalid_field", "generate.max_tokens"),
    (gen(max_tokens=None), "invalid_field", "generate.max_tokens"),
    (gen(max_tokens=2**64 - 1), "invalid_field", "generate.max_tokens"),
    (gen(temperature=-0.1), "invalid_field", "generate.temperature"),
    (gen(temperature=math.nan), "invalid_field", "generate.temperature"),
    (gen(temperature=math.inf), "invalid_field", "generate.temperature"),
    (gen(temperature=False), "invalid_field", "generate.temperature"),
    (gen(top_p=0.0), "invalid_field", "generate.top_p"),
    (gen(top_p=1.5), "invalid_field", "generate.top_p"),
    (gen(top_k=-1), "invalid_field", "generate.top_k"),
    (gen(seed=-1), "invalid_field", "generate.seed"),
    (gen(seed=2**63), "invalid_field", "generate.seed"),
    (gen(seed="1"), "invalid_field", "generate.seed"),
    (gen(stop="x"), "invalid_field", "generate.stop"),
    (gen(stop=[""]), "invalid_field", "generate.stop[0]"),
    (gen(stop=["a", 1]), "invalid_field", "generate.stop[1]"),
    (gen(stop=["a"] * 17), "invalid_field", "generate.stop"),
    (gen(stop=["x" * 257]), "invalid_field", "generate.stop[0]"),
    (gen(stream=1), "invalid_field", "generate.stream"),
    (gen(stream=None), "invalid_field", "generate.stream"),
    (gen(spec=[]), "invalid_field", "generate.spec"),
    (gen(spec={"max_k": -1}), "invalid_field", "generate.spec.max_k"),
    (gen(spec={"max_k": 1.5}), "invalid_field", "generate.spec.max_k"),
    (gen(spec={"proposer": ""}), "invalid_field", "generate.spec.proposer"),
    (gen(spec={"k": 1}), "invalid_field", "generate.spec.k"),
    (gen(max_token=5), "invalid_field", "generate.max_token"),
]


@pytest.mark.parametrize("frame,code,text", BAD, ids=[f"{i}-{c}" for i, (_, c, _) in enumerate(BAD)])
def test_bad_input_raises_protocol_error_naming_the_problem(frame, code, text):
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.code == ErrorCode(code)
    assert text in info.value.message, info.value.message


def test_error_carries_the_request_id_when_it_is_readable():
    with pytest.raises(ProtocolError) as info:
        decode(gen(max_tokens=-1))
    assert info.value.request_id == "r1"
    with pytest.raises(ProtocolError) as info:
        decode(pack(type="generate", id=3, prompt="x"))
    assert info.value.request_id is None
    with pytest.raises(ProtocolError) as info:  # even before the version check
        decode(msgpack.packb({"v": 9, "type": "cancel", "id": "q"}))
    assert info.value.request_id == "q"


def test_server_messages_ignore_unknown_fields_but_check_types():
    raw = msgpack.unpackb(encode(Chunk("a", [1], "x")))
    assert decode(msgpack.packb({**raw, "future_field": [1]}), allowed=SERVER_TYPES) == Chunk("a", [1], "x")
    with pytest.raises(ProtocolError, match="chunk.token_ids"):
        decode(msgpack.packb({**raw, "token_ids": "x"}), allowed=SERVER_TYPES)
    with pytest.raises(ProtocolError, match="unknown message type 'generate'"):
        decode(encode(Generate("a", prompt="x")), allowed=SERVER_TYPES)


def test_stats_reply_startup_is_optional_both_ways():
    """A server without start-up times (or an older one) sends no ``startup``: null; a newer server's
    extra milestone inside it is ignored, a wrong type is not."""
    raw = msgpack.unpackb(encode(StatsReply("s", startup=StartupStats(listening_s=3.5))))
    assert raw["startup"]["listening_s"] == 3.5 and raw["startup"]["tokenizer_s"] is None
    del raw["startup"]
    assert decode(msgpack.packb(raw), allowed=SERVER_TYPES).startup is None
    raw["startup"] = {"clock": "proc", "listening_s": 2.0, "future_s": 1.0}
    assert decode(msgpack.packb(raw), allowed=SERVER_TYPES).startup == StartupStats(listening_s=2.0)
    raw["startup"] = {"listening_s": "soon"}
    with pytest.raises(ProtocolError, match=r"stats_reply\.startup\.listening_s: must be a number"):
        decode(msgpack.packb(raw), allowed=SERVER_TYPES)


def test_docs_describe_every_field_and_error_code():
    text = DOCS.read_text()
    for code in ErrorCode:
        assert f"`{code.value}`" in text, f"error code {code.value} is not documented"
    for cls in (Generate, Cancel, Stats, Health, Chunk, Done, Error, StatsReply, HealthReply):
        assert f"`{cls.TYPE}`" in text, f"message type {cls.TYPE} is not documented"
        for f in fields(cls):
            assert f"`{f.name}`" in text, f"{cls.TYPE}.{f.name} is not documented"
    for cls in (SpecOptions, ChatMessage, Usage, SpecUsage, ProposerStats, ScorerStats, StartupStats):
        for f in fields(cls):
            assert re.search(rf"\b{f.name}\b", text), f"{cls.__name__}.{f.name} is not documented"


def _reference_plain(value):
    """The encoder's first, plain walk (fields() per value): what the fast path must reproduce."""
    import dataclasses
    import enum

    if dataclasses.is_dataclass(value):
        return {f.name: _reference_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _reference_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_reference_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


ODD_VALUES = [  # enums, tuples and nested lists where the fast path takes its other branches
    Error("a", ErrorCode.INVALID_FIELD, "generate.max_tokens: ..."),
    Chunk("b", (4, 5), "x"),
    StatsReply("n", engine={"k": (1, [2, ErrorCode.OVERLOADED]), 3: None, "f": 1.5, "b": b"\x00"}),
]


@pytest.mark.parametrize("msg", CLIENT_MESSAGES + SERVER_MESSAGES + ODD_VALUES, ids=lambda m: m.TYPE)
def test_encode_gives_the_bytes_of_the_plain_walk(msg):
    import dataclasses

    from specsched.daemon.messages import PROTOCOL_VERSION

    out = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if value is None and f.name in getattr(msg, "OMIT_NONE", ()):
            continue
        out[f.name] = _reference_plain(value)
    assert encode(msg) == msgpack.packb(out, use_bin_type=True)
