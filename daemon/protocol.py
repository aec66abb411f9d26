"""Wire protocol v1: one msgpack map per ZeroMQ message, with ``"v": 1`` and ``"type"``.

One dataclass per message type and one codec: :func:`encode` turns a message into bytes, :func:`decode`
turns a frame into a message or raises :class:`ProtocolError` naming the bad field. Client -> server
messages are validated strictly (unknown fields rejected, ``bool`` is not an int, NaN/inf rejected);
server -> client messages are read leniently (unknown fields ignored) so that v1 servers may add
fields. The full description for client writers is docs/protocol.md.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1
MAX_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_CHAT_MESSAGES = 1024
MAX_TOKEN_ID = 2**31 - 1
MAX_MAX_TOKENS = 1_000_000
MAX_TEMPERATURE = 100.0
MAX_SPEC_K = 1024
MAX_PROPOSER_CHARS = 64
MAX_TIMEOUT_S = 604_800.0  # generate.timeout: one week at most
MAX_MAP_KEYS = 1024  # any map in any message: more keys are refused while parsing, before they are built
CHAT_ROLES = ("system", "user", "assistant", "tool")


class ErrorCode(str, enum.Enum):
    BAD_MESSAGE = "bad_message"  # not msgpack, not a map, missing or wrong "v", more than one frame
    UNKNOWN_TYPE = "unknown_type"  # "type" is a string but not a known message type
    INVALID_FIELD = "invalid_field"  # missing / wrong type / out of range / unknown field
    DUPLICATE_ID = "duplicate_id"  # this client already has a request in flight with that id
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt tokens > max_prompt_tokens or leave no room to generate
    UNKNOWN_PROPOSER = "unknown_proposer"  # spec.proposer names no proposer of this daemon
    UNKNOWN_ID = "unknown_id"  # cancel of an id this client has not in flight
    OVERLOADED = "overloaded"  # the daemon's queue is full
    TOO_MANY_INFLIGHT = "too_many_inflight"  # this client has max_inflight_per_client requests in flight
    SHUTTING_DOWN = "shutting_down"  # the daemon is stopping and accepts no new requests
    INTERNAL = "internal"  # a bug or an engine failure while serving the request


class ProtocolError(ValueError):
    """A message that cannot be served; becomes an ``error`` reply with ``code`` and ``message``."""

    def __init__(self, code: ErrorCode | str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{ErrorCode(code).value}: {message}")
        self.code = ErrorCode(code)
        self.message = message
        self.request_id = request_id


# ---- field validators ------------------------------------------------------------------------------

_REQUIRED = object()
_WIRE_NAMES = {
    bool: "bool",
    int: "int",
    float: "float",
    str: "string",
    bytes: "binary",
    list: "array",
    dict: "map",
    type(None): "nil",
}


def _tname(value: Any) -> str:
    return _WIRE_NAMES.get(type(value), type(value).__name__)


def _bad(path: str, problem: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: {problem}")


def str_(lo: int, hi: int | None):
    def check(v, path):
        if not isinstance(v, str):
            raise _bad(path, f"must be a string, got {_tname(v)}")
        if len(v) < lo or (hi is not None and len(v) > hi):
            raise _bad(path, f"length must be in [{lo}, {hi if hi is not None else 'inf'}], got {len(v)}")
        return v

    return check


def int_(lo: int | None, hi: int | None):
    def check(v, path):
        if type(v) is not int:  # bool is not an int on the wire
            raise _bad(path, f"must be an int, got {_tname(v)}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise _bad(path, f"must be in [{lo}, {hi}], got {v}")
        return v

    return check


def float_(lo: float | None, hi: float | None, *, lo_open: bool = False):
    def check(v, path):
        if type(v) not in (int, float):
            raise _bad(path, f"must be a number, got {_tname(v)}")
        if not math.isfinite(v):
            raise _bad(path, f"must be finite, got {v}")
        if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
            raise _bad(path, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
        return float(v)

    return check


def bool_(v, path):
    if type(v) is not bool:
        raise _bad(path, f"must be a bool, got {_tname(v)}")
    return v


def list_(item, lo: int, hi: int | None):
    def check(v, path):
        if not isinstance(v, list):
            raise _bad(path, f"must be an array, got {_tname(v)}")
        if len(v) < lo or (hi is not None and len(v) > hi):
            raise _bad(path, f"must have [{lo}, {hi if hi is not None else 'inf'}] entries, got {len(v)}")
        return [item(x, f"{path}[{i}]") for i, x in enumerate(v)]

    return check


def map_():
    def check(v, path):
        if not isinstance(v, dict):
            raise _bad(path, f"must be a map, got {_tname(v)}")
        return v

    return check


class FieldReader:
    """Reads the fields of one map; ``finish()`` rejects unread keys when ``strict``."""

    def __init__(
        self, obj: dict, where: str, *, strict: bool, request_id: str | None = None, skip=()
    ) -> None:
        self.obj, self.where, self.strict, self.request_id = obj, where, strict, request_id
        self._seen = set(skip)

    def get(self, name: str, check, *, default: Any = _REQUIRED, nullable: bool = False):
        self._seen.add(name)
        path = f"{self.where}.{name}"
        if name not in self.obj:
            if default is _REQUIRED:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD, f"{path}: required field is missing", self.request_id
                )
            return copy.deepcopy(default)
        value = self.obj[name]
        if value is None:
            if nullable:
                return None
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: must not be nil", self.request_id)
        try:
            return check(value, path)
        except ProtocolError as e:
            e.request_id = e.request_id or self.request_id
            raise

    def finish(self) -> None:
        if not self.strict:
            return
        extra = [k for k in self.obj if k not in self._seen]
        if extra:
            name = str(extra[0])[:40]
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, f"{self.where}.{name}: unknown field", self.request_id
            )


# ---- client -> server ------------------------------------------------------------------------------


@dataclass
class ChatMessage:
    role: str
    content: str


@dataclass
class SpecOptions:
    max_k: int | None = None  # cap on speculated tokens per step; None = the daemon's
    proposer: str | None = None  # proposer name; None = the daemon's default


@dataclass
class Generate:
    TYPE: ClassVar[str] = "generate"
    OMIT_NONE: ClassVar[tuple[str, ...]] = ("prompt", "prompt_ids", "messages", "timeout")
    id: str
    prompt: str | None = None  # raw text (tokenized by the daemon)
    prompt_ids: list[int] | None = None  # token ids as they are
    messages: list[ChatMessage] | None = None  # chat, rendered with the model's chat template
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = True
    spec: SpecOptions = field(default_factory=SpecOptions)
    timeout: float | None = None  # seconds from arrival; then done with finish_reason "timeout"


@dataclass
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    id: str


@dataclass
class Stats:
    TYPE: ClassVar[str] = "stats"
    id: str | None = None  # echoed in the reply, for matching


@dataclass
class Health:
    TYPE: ClassVar[str] = "health"
    id: str | None = None


# ---- server -> client ------------------------------------------------------------------------------


@dataclass
class Chunk:
    TYPE: ClassVar[str] = "chunk"
    id: str
    token_ids: list[int]  # new tokens since the previous chunk (may be empty when only text is flushed)
    text: str  # new text since the previous chunk
    proposed: int = 0  # draft tokens proposed for this request in the steps this chunk covers
    accepted: int = 0  # of which accepted


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class SpecUsage:
    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # engine steps that emitted tokens for this request


@dataclass
class Done:
    TYPE: ClassVar[str] = "done"
    id: str
    finish_reason: str  # stop | length | abort | timeout | error
    usage: Usage = field(default_factory=Usage)
    spec: SpecUsage = field(default_factory=SpecUsage)
    text: str | None = None  # full text when the request had stream=false
    token_ids: list[int] | None = None  # all output ids when the request had stream=false


@dataclass
class Error:
    TYPE: ClassVar[str] = "error"
    id: str | None
    code: str
    message: str


@dataclass
class ProposerStats:
    proposed: int = 0
    accepted: int = 0
    rate: float = 0.0  # accepted / proposed


@dataclass
class ScorerStats:
    steps: int = 0
    mean_step_ms: float = 0.0  # whole step (schedule .. commit)
    mean_score_ms: float = 0.0  # the scorer's forward


@dataclass
class StatsReply:
    TYPE: ClassVar[str] = "stats_reply"
    id: str | None = None
    uptime_s: float = 0.0
    num_waiting: int = 0  # queue depth (admitted, not yet running)
    num_running: int = 0
    num_inflight: int = 0  # requests the daemon holds for all clients
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    tokens_per_s: float = 0.0  # output tokens over the recent window
    num_requests_done: int = 0  # finished with stop or length
    num_requests_aborted: int = 0  # cancelled, client gone, shutdown
    num_requests_errored: int = 0  # internal error or error finish while running
    num_requests_rejected: int = 0  # generate answered with an error before running
    num_bad_messages: int = 0  # frames that failed to decode
    num_log_failures: int = 0
    proposers: dict[str, ProposerStats] = field(default_factory=dict)
    scorers: dict[str, ScorerStats] = field(default_factory=dict)
    engine: dict = field(default_factory=dict)  # the engine's own counters, free-form
    num_requests_timed_out: int = 0  # finished with finish_reason timeout (their deadline passed)
    num_preemptions: int = 0  # running requests preempted (KV blocks ran out) and recomputed later
    num_log_dropped: int = 0  # decision-log records dropped (queue full or writes failing too long)
    num_auth_denied: int = 0  # CURVE handshakes refused (client key not allowed)
    num_clients: int = 0  # connections with requests in flight
    rss_bytes: int = 0  # the daemon's resident memory (VmRSS); 0 where /proc is not available


@dataclass
class HealthReply:
    TYPE: ClassVar[str] = "health_reply"
    id: str | None = None
    status: str = "ok"  # ok | shutting_down
    model: str = ""
    uptime_s: float = 0.0


Message = Generate | Cancel | Stats | Health | Chunk | Done | Error | StatsReply | HealthReply
CLIENT_TYPES = ("generate", "cancel", "stats", "health")
SERVER_TYPES = ("chunk", "done", "error", "stats_reply", "health_reply")


# ---- encode ----------------------------------------------------------------------------------------


def _plain(value):
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


def encode(msg: Message) -> bytes:
    """One message -> one msgpack map (``v``, ``type``, then its fields). Does not validate: the
    server is the one source of truth for what is accepted."""
    out: dict = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    omit = getattr(msg, "OMIT_NONE", ())
    for f in fields(msg):
        value = getattr(msg, f.name)
        if value is None and f.name in omit:
            continue
        out[f.name] = _plain(value)
    return msgpack.packb(out, use_bin_type=True)


# ---- decode ----------------------------------------------------------------------------------------

_ID = str_(1, MAX_ID_CHARS)


def _decode_spec(value, path: str) -> SpecOptions:
    r = FieldReader(map_()(value, path), path, strict=True)
    spec = SpecOptions(
        max_k=r.get("max_k", int_(0, MAX_SPEC_K), default=None, nullable=True),
        proposer=r.get("proposer", str_(1, MAX_PROPOSER_CHARS), default=None, nullable=True),
    )
    r.finish()
    return spec


def _decode_chat(value, path: str) -> ChatMessage:
    r = FieldReader(map_()(value, path), path, strict=True)
    role = r.get("role", str_(1, 32))
    if role not in CHAT_ROLES:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"{path}.role: must be one of {', '.join(CHAT_ROLES)}")
    msg = ChatMessage(role=role, content=r.get("content", str_(0, None)))
    r.finish()
    return msg


def _decode_generate(r: FieldReader) -> Generate:
    msg = Generate(
        id=r.get("id", _ID),
        prompt=r.get("prompt", str_(1, None), default=None, nullable=True),
        prompt_ids=r.get("prompt_ids", list_(int_(0, MAX_TOKEN_ID), 1, None), default=None, nullable=True),
        messages=r.get("messages", list_(_decode_chat, 1, MAX_CHAT_MESSAGES), default=None, nullable=True),
        max_tokens=r.get("max_tokens", int_(1, MAX_MAX_TOKENS), default=64),
        temperature=r.get("temperature", float_(0.0, MAX_TEMPERATURE), default=0.0),
        top_p=r.get("top_p", float_(0.0, 1.0, lo_open=True), default=1.0),
        top_k=r.get("top_k", int_(0, MAX_TOKEN_ID), default=0),
        seed=r.get("seed", int_(0, 2**63 - 1), default=None, nullable=True),
        stop=r.get("stop", list_(str_(1, MAX_STOP_CHARS), 0, MAX_STOP_STRINGS), default=[]),
        stream=r.get("stream", bool_, default=True),
        spec=r.get("spec", _decode_spec, default=SpecOptions()),
        timeout=r.get("timeout", float_(0.0, MAX_TIMEOUT_S, lo_open=True), default=None, nullable=True),
    )
    given = [n for n in ("prompt", "prompt_ids", "messages") if getattr(msg, n) is not None]
    if len(given) != 1:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"generate: exactly one of prompt, prompt_ids, messages is required, got {given or 'none'}",
            msg.id,
        )
    return msg


_LENIENT = {
    "str": str_(0, None),
    "int": int_(None, None),
    "float": float_(None, None),
    "bool": bool_,
    "list[int]": list_(int_(None, None), 0, None),
    "dict": map_(),
}
_NESTED = {c.__name__: c for c in (Usage, SpecUsage, ProposerStats, ScorerStats)}


def _lenient(cls, value, path: str):
    """A server -> client map into ``cls``, type-checked from the dataclass's annotations (which are
    strings under postponed evaluation); unknown keys are ignored (v1 servers may add fields)."""
    r = FieldReader(map_()(value, path), path, strict=False)
    kwargs = {}
    for f in fields(cls):
        base, nullable = f.type.removesuffix(" | None"), f.type.endswith(" | None")
        if base in _NESTED:
            check = lambda v, p, c=_NESTED[base]: _lenient(c, v, p)
        elif base.startswith("dict[str, "):
            check = lambda v, p, c=_NESTED[base[10:-1]]: {
                str(k): _lenient(c, x, f"{p}.{k}") for k, x in map_()(v, p).items()
            }
        else:
            check = _LENIENT[base]
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = _REQUIRED
        kwargs[f.name] = r.get(f.name, check, default=default, nullable=nullable)
    return cls(**kwargs)


_DECODERS = {
    "generate": _decode_generate,
    "cancel": lambda r: Cancel(id=r.get("id", _ID)),
    "stats": lambda r: Stats(id=r.get("id", _ID, default=None, nullable=True)),
    "health": lambda r: Health(id=r.get("id", _ID, default=None, nullable=True)),
}
_SERVER_CLASSES = {c.TYPE: c for c in (Chunk, Done, Error, StatsReply, HealthReply)}


def _guess_id(obj: dict) -> str | None:
    rid = obj.get("id")
    return rid if isinstance(rid, str) and 1 <= len(rid) <= MAX_ID_CHARS else None


def decode(frame: bytes, *, allowed: tuple[str, ...] = CLIENT_TYPES) -> Message:
    """Parse one frame into a message of one of the ``allowed`` types (the server passes
    CLIENT_TYPES, a client SERVER_TYPES). Raises :class:`ProtocolError` naming the problem."""
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True, max_map_len=MAX_MAP_KEYS)
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE, f"frame is not one msgpack value ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"message must be a msgpack map, got {type(obj).__name__}")
    rid = _guess_id(obj)
    v = obj.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        got = "missing" if "v" not in obj else repr(v)[:40]
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE, f"v: protocol version must be {PROTOCOL_VERSION}, got {got}", rid
        )
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, "type: required string field is missing or not a string", rid
        )
    if kind not in allowed:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE,
            f"type: unknown message type {kind[:40]!r}; known: {', '.join(allowed)}",
            rid,
        )
    if kind in _SERVER_CLASSES:
        return _lenient(_SERVER_CLASSES[kind], obj, kind)
    reader = FieldReader(obj, kind, strict=True, request_id=rid, skip=("v", "type"))
    msg = _DECODERS[kind](reader)
    reader.finish()
    return msg
