"""Fuzz the daemon with thousands of malformed messages (hypothesis): every one gets an ``error``
reply, and a valid request afterwards still succeeds. One daemon, one socket for the whole module.

The invalid values come from the limits documented in docs/protocol.md, not from the decoder."""

from __future__ import annotations

import math

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

ERROR_CODES = {
    "bad_message",
    "unknown_type",
    "invalid_field",
    "duplicate_id",
    "prompt_too_long",
    "unknown_proposer",
    "unknown_id",
    "overloaded",
    "too_many_inflight",
    "shutting_down",
    "internal",
}
FUZZ = settings(
    max_examples=1200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# ---- strategies ------------------------------------------------------------------------------------

I64_MIN, U64_MAX = -(2**63), 2**64 - 1  # what msgpack can carry


def ints(lo: int = I64_MIN, hi: int = U64_MAX):
    return st.integers(lo, hi)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
not_int = st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=4), st.lists(ints(), max_size=2))
not_number = st.one_of(st.none(), st.booleans(), st.text(max_size=4), st.lists(st.floats(), max_size=2))
not_str = st.one_of(st.none(), st.booleans(), ints(), st.floats(), st.binary(max_size=4), st.lists(st.text()))
bad_float = st.sampled_from([math.nan, math.inf, -math.inf])
ids = st.text(min_size=1, max_size=128)

# documented field -> values it must never accept (wrong type or out of range)
INVALID = {
    "id": st.one_of(
        not_str.filter(lambda v: v is not None), st.just(""), st.text(min_size=129, max_size=200)
    ),
    "prompt_ids": st.one_of(
        st.just([]),
        st.lists(ints(hi=-1), min_size=1, max_size=3),
        st.lists(ints(2**31), min_size=1, max_size=3),
        st.lists(st.one_of(st.booleans(), st.floats(), st.text(max_size=2)), min_size=1, max_size=3),
        st.text(max_size=4),
        ints(),
        st.booleans(),
        st.dictionaries(st.text(max_size=3), ints()),
    ),
    "max_tokens": st.one_of(
        not_int.filter(lambda v: v is not None),
        ints(hi=0),
        ints(1_000_001),
    ),
    "temperature": st.one_of(
        not_number.filter(lambda v: v is not None),
        bad_float,
        st.floats(max_value=-1e-9),
        st.floats(min_value=100.001, allow_infinity=False),
    ),
    "top_p": st.one_of(
        not_number.filter(lambda v: v is not None),
        bad_float,
        st.floats(max_value=0.0),
        st.floats(min_value=1.0001, allow_infinity=False),
    ),
    "top_k": st.one_of(not_int.filter(lambda v: v is not None), ints(hi=-1)),
    "seed": st.one_of(
        st.booleans(),
        st.floats(),
        st.text(max_size=3),
        ints(hi=-1),
        ints(2**63),
    ),
    "stop": st.one_of(
        st.text(max_size=3),
        ints(),
        st.lists(st.just(""), min_size=1, max_size=2),
        st.lists(st.text(min_size=1, max_size=4), min_size=17, max_size=20),
        st.lists(st.one_of(ints(), st.none(), st.binary(max_size=3)), min_size=1, max_size=3),
    ),
    "stream": st.one_of(ints(), st.floats(), st.text(max_size=3), st.lists(st.booleans(), max_size=1)),
    "spec": st.one_of(
        ints(),
        st.text(max_size=3),
        st.lists(ints(), max_size=2),
        st.fixed_dictionaries(
            {
                "max_k": st.one_of(
                    ints(hi=-1),
                    ints(1025),
                    st.booleans(),
                    st.floats(),
                    st.text(max_size=2),
                )
            }
        ),
        st.fixed_dictionaries(
            {"proposer": st.one_of(st.just(""), ints(), st.booleans(), st.text(min_size=65, max_size=70))}
        ),
        st.dictionaries(
            st.text(max_size=6).filter(lambda k: k not in ("max_k", "proposer")),
            ints(),
            min_size=1,
            max_size=2,
        ),
    ),
    "messages": st.one_of(
        st.just([]),
        st.text(max_size=3),
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.text(max_size=8).filter(
                        lambda r: r not in ("system", "user", "assistant", "tool")
                    ),
                    "content": st.text(max_size=4),
                }
            ),
            min_size=1,
            max_size=2,
        ),
        st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": not_str}), min_size=1, max_size=2
        ),
        st.lists(st.fixed_dictionaries({"role": st.just("user")}), min_size=1, max_size=2),
    ),
}
KNOWN = {
    "v",
    "type",
    "id",
    "prompt",
    "prompt_ids",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "timeout",
    "spec",
}


@st.composite
def mutated(draw) -> tuple[dict, str | None]:
    """A valid message with exactly one documented-invalid change; returns it and the id its error
    must carry (None when the id itself is broken)."""
    rid = draw(ids)
    kind = draw(st.sampled_from(["generate", "generate", "generate", "cancel", "stats", "health"]))
    base = {"v": 1, "type": kind, "id": rid}
    if kind == "generate":
        base.update(
            prompt_ids=[1, 2, 3],
            max_tokens=1,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            seed=None,
            stop=[],
            stream=True,
            spec={},
        )
    how = draw(st.sampled_from(["field", "field", "unknown_key", "drop", "version", "type", "prompts"]))
    if how == "field" and kind == "generate":
        name = draw(st.sampled_from(sorted(INVALID)))
        if name == "messages":
            del base["prompt_ids"]
        base[name] = draw(INVALID[name])
        return base, None if name == "id" else rid
    if how == "field":  # cancel / stats / health: only the id
        base["id"] = draw(INVALID["id"])
        return base, None
    if how == "unknown_key":
        base[draw(st.text(max_size=10).filter(lambda k: k not in KNOWN))] = draw(scalars)
        return base, rid
    if how == "drop":
        droppable = {"generate": ["v", "type", "id", "prompt_ids"], "cancel": ["v", "type", "id"]}
        name = draw(st.sampled_from(droppable.get(kind, ["v", "type"])))
        del base[name]
        return base, None if name == "id" else rid
    if how == "version":
        base["v"] = draw(st.one_of(ints().filter(lambda v: v != 1), st.just(True), st.just(1.0), st.text()))
        return base, rid
    if how == "type":
        base["type"] = draw(
            st.one_of(
                st.text().filter(lambda t: t not in ("generate", "cancel", "stats", "health")),
                ints(),
                st.none(),
                st.binary(max_size=4),
            )
        )
        return base, rid
    if kind != "generate":  # "prompts" only applies to generate: fall back to a broken id
        base["id"] = draw(INVALID["id"])
        return base, None
    extra = draw(st.sampled_from(["prompt", "messages"]))
    base[extra] = "hi" if extra == "prompt" else [{"role": "user", "content": "hi"}]
    return base, rid


# ---- the daemon ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sock(tiny_daemon):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(tiny_daemon.endpoint)
    yield s
    valid = {"v": 1, "type": "generate", "id": "after-fuzz", "prompt_ids": [1, 2, 3], "max_tokens": 3}
    s.send(msgpack.packb(valid))
    while True:  # the daemon still serves: chunks, then done
        reply = expect_reply(s)
        assert reply["type"] in ("chunk", "done"), reply
        if reply["type"] == "done":
            assert reply["usage"]["completion_tokens"] >= 1
            break
    s.close()


def expect_reply(s: zmq.Socket) -> dict:
    assert s.poll(10_000), "no reply within 10 s"
    return msgpack.unpackb(s.recv())


def expect_error(s: zmq.Socket) -> dict:
    reply = expect_reply(s)
    assert reply["type"] == "error", reply
    assert reply["code"] in ERROR_CODES and isinstance(reply["message"], str) and reply["message"]
    return reply


@FUZZ
@given(frame=st.binary(max_size=300))
def test_random_bytes(sock, frame):
    try:
        obj = msgpack.unpackb(frame)
    except Exception:  # noqa: BLE001 -- most random bytes are not msgpack at all
        obj = None
    assume(not (isinstance(obj, dict) and obj.get("type") in ("generate", "stats", "health")))
    sock.send(frame)
    expect_error(sock)


@FUZZ
@given(obj=values)
def test_random_msgpack_values(sock, obj):
    assume(not (isinstance(obj, dict) and obj.get("type") in ("generate", "stats", "health")))
    sock.send(msgpack.packb(obj, use_bin_type=True))
    expect_error(sock)


@settings(FUZZ, max_examples=2000)
@given(case=mutated())
def test_valid_messages_with_one_invalid_field(sock, case):
    msg, rid = case
    sock.send(msgpack.packb(msg, use_bin_type=True))
    err = expect_error(sock)
    assert err["id"] == rid
    assert err["code"] in ("bad_message", "unknown_type", "invalid_field"), err
