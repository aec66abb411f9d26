"""Hostile input, structure-aware: deep nesting, huge (and falsely announced) arrays, NaN/inf numbers,
out-of-range seeds, unicode edge cases, 10^6-token prompts. Every message gets exactly one ``error``
(none hangs), the daemon keeps serving, and its memory returns near its baseline afterwards.

Frames are built by hand where msgpack-python would refuse to build them (nesting deeper than its
packer allows, invalid UTF-8 in a ``str``, headers announcing more than follows)."""

from __future__ import annotations

import math
import struct
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow
MB = 1 << 20
MAX_MESSAGE = 8 * MB  # the daemon's limit here: large enough for a 10^6-token prompt to arrive
FIELDS = ["prompt", "prompt_ids", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "spec", "timeout", "no_such_field"]  # fmt: skip
NUM_CASES = {"count": 0}


# ---- hand-made msgpack -------------------------------------------------------------------------------


def map_header(n: int) -> bytes:
    return (
        bytes([0x80 | n])
        if n < 16
        else b"\xde" + struct.pack(">H", n)
        if n < 1 << 16
        else b"\xdf" + struct.pack(">I", n)
    )


def array_header(n: int) -> bytes:
    return (
        bytes([0x90 | n])
        if n < 16
        else b"\xdc" + struct.pack(">H", n)
        if n < 1 << 16
        else b"\xdd" + struct.pack(">I", n)
    )


def raw_str(data: bytes) -> bytes:
    """A msgpack ``str`` holding ``data`` as it is (valid UTF-8 or not)."""
    return (bytes([0xA0 | len(data)]) if len(data) < 32 else b"\xd9" + bytes([len(data)]) if len(data) < 256
            else b"\xdb" + struct.pack(">I", len(data))) + data  # fmt: skip


def frame(fields: dict[str, bytes | object]) -> bytes:
    """A map whose values are msgpack bytes (``bytes``, used as they are) or objects to pack."""
    out = [map_header(len(fields))]
    for key, value in fields.items():
        out.append(msgpack.packb(key))
        out.append(value if isinstance(value, bytes) else msgpack.packb(value, use_bin_type=True))
    return b"".join(out)


def with_raw_key(msg: dict, key: bytes) -> bytes:
    """``msg`` plus one entry whose key is a ``str`` holding the raw bytes ``key``."""
    n = len(msg)
    return map_header(n + 1) + frame(msg)[len(map_header(n)) :] + raw_str(key) + b"\x01"


def generate(rid: str, **override) -> dict:
    return {"v": 1, "type": "generate", "id": rid, "prompt_ids": [5, 6, 7], "max_tokens": 4, **override}


def nested(depth: int, kind: str) -> bytes:
    """``depth`` nested one-element arrays or maps around a nil."""
    head = b"\x91" if kind == "array" else b"\x81\xa1k"
    return head * depth + b"\xc0"


# ---- the daemon --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile(start_daemon):
    d = start_daemon(daemon={"max_message_bytes": MAX_MESSAGE})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    for i in range(3):  # warm up: the first requests allocate what serving keeps
        assert ask_done(sock, generate(f"warm{i}", max_tokens=16))
    d.baseline_rss = d.rss_bytes()
    d.peak_rss = d.baseline_rss
    yield d, sock
    assert ask_done(sock, generate("after", max_tokens=8)), "the daemon must still serve"
    sock.close()
    time.sleep(0.5)
    end = d.rss_bytes()
    print(f"\nhostile: {NUM_CASES['count']} cases; RSS baseline {d.baseline_rss / MB:.1f} MB, "
          f"peak {d.peak_rss / MB:.1f} MB, after {end / MB:.1f} MB")  # fmt: skip
    assert end - d.baseline_rss < 48 * MB, "memory did not return near its baseline"


def ask_done(sock, msg: dict) -> bool:
    sock.send(msgpack.packb(msg))
    while True:
        assert sock.poll(30_000), "no reply"
        reply = msgpack.unpackb(sock.recv())
        if reply["type"] != "chunk":
            return reply["type"] == "done"


def expect_one_error(
    hostile_daemon, data: bytes, rid: str | None, codes: set[str], timeout_s: float = 30
) -> dict:
    d, sock = hostile_daemon
    NUM_CASES["count"] += 1
    sock.send(data)
    assert sock.poll(timeout_s * 1e3), f"no reply within {timeout_s} s"
    reply = msgpack.unpackb(sock.recv())
    assert reply["type"] == "error" and reply["code"] in codes, reply
    assert reply["id"] == rid, reply
    assert not sock.poll(0), "exactly one reply"
    d.peak_rss = max(d.peak_rss, d.rss_bytes())
    return reply


# ---- deterministic heavy cases -------------------------------------------------------------------------


def _messages_1e5() -> bytes:
    return frame({**generate("h5", messages=[{"role": "user", "content": ""}] * 10**5), "prompt_ids": None})


HEAVY = {  # name: (frame builder, id of the error, its code)
    # 10^6 ids of one byte each (1 MB) and of three bytes each (3 MB): decoded, then too long
    "prompt_ids_1e6_small": (lambda: frame(generate("h1", prompt_ids=[7] * 10**6)), "h1", "prompt_too_long"),
    "prompt_ids_1e6_wide": (lambda: frame(generate("h2", prompt_ids=[60_000] * 10**6)), "h2",
                            "prompt_too_long"),
    "prompt_ids_1e6_last_bad": (lambda: frame(generate("h3", prompt_ids=[7] * (10**6 - 1) + [-1])), "h3",
                                "invalid_field"),
    "stop_1e5_strings": (lambda: frame(generate("h4", stop=["x"] * 10**5)), "h4", "invalid_field"),
    "messages_1e5": (_messages_1e5, "h5", "invalid_field"),
    "unknown_field_1e6_nils": (lambda: frame({**generate("h6"), "junk": array_header(10**6) + b"\0" * 10**6}),
                               "h6", "invalid_field"),
    "map_1e5_keys": (lambda: frame({**generate("h7"), **{f"k{i}": i for i in range(10**5)}}), None,
                     "bad_message"),  # refused while parsing (more than 1024 keys)
    "prompt_7mb": (lambda: frame(generate("h8", prompt="x" * (7 * MB), prompt_ids=None)), "h8",
                   "invalid_field"),
    "nesting_1e5_arrays": (lambda: frame({**generate("h9"), "spec": nested(10**5, "array")}), None,
                           "bad_message"),
    "nesting_1e5_maps": (lambda: frame({**generate("h10"), "stop": nested(10**5, "map")}), None,
                         "bad_message"),
    # headers that announce far more than the frame holds: nothing of the announced size is allocated
    "array32_announced_4g": (lambda: frame({**generate("h11"), "stop": b"\xdd\xff\xff\xff\xff\xc0"}), None,
                             "bad_message"),
    "str32_announced_4g": (lambda: frame({**generate("h12"), "prompt": b"\xdb\xff\xff\xff\xffabc"}), None,
                           "bad_message"),
    "map32_announced_4g": (lambda: b"\xdf\xff\xff\xff\xff" + msgpack.packb("v") + b"\x01", None,
                           "bad_message"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HEAVY))
def test_heavy_hostile_messages(hostile, name):
    build, rid, code = HEAVY[name]
    data = build()
    assert len(data) < MAX_MESSAGE
    reply = expect_one_error(hostile, data, rid, {code})
    if name.startswith("prompt_ids_1e6_last"):
        assert "prompt_ids[999999]" in reply["message"]
    if name == "map_1e5_keys":
        assert "max_map_len" in reply["message"]


def test_what_msgpack_cannot_carry():
    """Lone surrogates and integers beyond 64 bits cannot even be encoded: no client can send them
    as such (a surrogate smuggled in as bytes is invalid UTF-8: see the fuzz test below)."""
    with pytest.raises(UnicodeEncodeError):
        msgpack.packb(generate("s", stop=["\ud800"]))
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(OverflowError):
            msgpack.packb(generate("s", seed=seed))


# ---- structure-aware fuzzing -----------------------------------------------------------------------------

BAD_UTF8 = [
    b"\xed\xa0\x80",  # a lone high surrogate (U+D800), CESU-style
    b"\xed\xbf\xbf",  # a lone low surrogate
    b"\xc0\xaf",  # overlong '/'
    b"\xe2\x82",  # truncated
    b"\xf4\x90\x80\x80",  # beyond U+10FFFF
    b"\xff",
    b"\xf8\x88\x80\x80\x80",  # a 5-byte form
]
NASTY_TEXT = st.text(
    alphabet=st.sampled_from(["\u0000", "\u200d", "\u202e", "\ufeff", "\uffff", "\U0010ffff", "\u0301", "🚀",
                              "\U000e0041", "ß", "İ", "\r", "\u2028", "a"]),
    min_size=1, max_size=300,
)  # fmt: skip
BAD_NUMBERS = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -0.0001, 1e308, -1e308])
BAD_SEEDS = st.one_of(st.integers(-(2**63), -1), st.integers(2**63, 2**64 - 1))


@st.composite
def hostile_case(draw) -> tuple[bytes, str | None, set[str]]:
    rid = draw(st.text(min_size=1, max_size=16))
    msg = generate(rid)
    kind = draw(st.sampled_from(["nesting", "array", "number", "seed", "utf8", "stop", "id"]))
    if kind == "nesting":  # deep structures where anything else belongs; past msgpack's limit: bad_message
        depth = draw(st.one_of(st.integers(1, 1000), st.integers(1100, 20_000)))  # msgpack stops at 1024
        name = draw(st.sampled_from(FIELDS))
        msg[name] = nested(depth, draw(st.sampled_from(["array", "map"])))
        if depth > 1024:
            return frame(msg), None, {"bad_message"}
        return frame(msg), rid, {"invalid_field"}
    if kind == "array":  # big arrays of junk in any field
        n = draw(st.integers(17, 20_000))
        item = draw(st.sampled_from([None, True, -1, 2**40, 1.5, "x", b"\x00", [], {}]))
        name = draw(st.sampled_from(FIELDS))
        msg[name] = [item] * n
        codes = {"invalid_field", "prompt_too_long"} if name == "prompt_ids" else {"invalid_field"}
        return frame(msg), rid, codes
    if kind == "number":
        msg[draw(st.sampled_from(["temperature", "top_p", "timeout"]))] = draw(BAD_NUMBERS)
        return frame(msg), rid, {"invalid_field"}
    if kind == "seed":
        msg["seed"] = draw(BAD_SEEDS)
        return frame(msg), rid, {"invalid_field"}
    if kind == "utf8":  # invalid UTF-8 inside a str, anywhere: the frame is not readable msgpack
        bad = draw(st.sampled_from(BAD_UTF8))
        where = draw(st.sampled_from(["stop", "prompt", "id", "key"]))
        if where == "stop":
            msg["stop"] = array_header(1) + raw_str(b"ok" + bad)
        elif where == "prompt":
            msg["prompt"], msg["prompt_ids"] = raw_str(bad * 3), None
        elif where == "id":
            msg["id"] = raw_str(bad)
        else:  # a key that is not UTF-8
            return with_raw_key(msg, bad), None, {"bad_message"}
        return frame(msg), None, {"bad_message"}
    if kind == "stop":  # valid unicode: too many, too long, or a model without a tokenizer
        stop = draw(st.lists(NASTY_TEXT, min_size=1, max_size=20))
        msg["stop"] = stop
        return frame(msg), rid, {"invalid_field"}
    msg["id"] = draw(st.one_of(st.just(""), st.text(min_size=129, max_size=300)))  # id out of range
    return frame(msg), None, {"invalid_field"}


@settings(
    max_examples=1000,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(case=hostile_case())
def test_structure_aware_fuzz(hostile, case):
    data, rid, codes = case
    expect_one_error(hostile, data, rid, codes)


# ---- unicode stop strings on a model with a tokenizer: valid ones are served ---------------------------


@settings(
    max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(stop=st.lists(NASTY_TEXT.filter(lambda s: len(s) <= 256), min_size=1, max_size=16))
def test_unicode_stop_strings_are_served(text_daemon, stop):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(text_daemon.endpoint)
    try:
        NUM_CASES["count"] += 1
        sock.send(msgpack.packb({"v": 1, "type": "generate", "id": "u", "prompt": "Grüße 🚀", "max_tokens": 8,
                                 "stop": stop, "stream": False}))  # fmt: skip
        assert sock.poll(30_000)
        reply = msgpack.unpackb(sock.recv())
        assert reply["type"] == "done" and reply["finish_reason"] in ("stop", "length"), reply
        assert not any(s in reply["text"] for s in stop)
    finally:
        sock.close()


@pytest.mark.soak
def test_soak_heavy_rounds_plateau(start_daemon):
    """40 rounds of every heavy case on a daemon of its own: RSS rises while the allocator's free lists
    fill with fragments of the freed multi-megabyte messages, then stays flat (no leak)."""
    d = start_daemon(daemon={"max_message_bytes": MAX_MESSAGE})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    d.peak_rss = baseline = d.rss_bytes()
    frames = [(build(), rid, {code}) for build, rid, code in HEAVY.values()]
    after = []
    try:
        for _ in range(40):
            for data, rid, codes in frames:
                expect_one_error((d, sock), data, rid, codes)
            after.append(d.rss_bytes())
        assert ask_done(sock, generate("after", max_tokens=8))
    finally:
        sock.close()
    print(f"\nRSS baseline {baseline / MB:.0f} MB, after each round: {[round(x / MB) for x in after]}")
    assert after[-1] - after[19] < 8 * MB and after[-1] - baseline < 96 * MB
