"""Protocol v1 messages: one dataclass per message type, the error codes and the limits on fields.

The codec (codec.py) turns these into msgpack maps and back; docs/protocol.md describes every field
for client writers. ``specsched.daemon.protocol`` re-exports all of it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

__all__ = [
    "CHAT_ROLES", "CLIENT_TYPES", "MAX_CHAT_MESSAGES", "MAX_ID_CHARS", "MAX_MAP_KEYS", "MAX_MAX_TOKENS",
    "MAX_PROPOSER_CHARS", "MAX_SPEC_K", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "MAX_TEMPERATURE",
    "MAX_TIMEOUT_S", "MAX_TOKEN_ID", "PROTOCOL_VERSION", "SERVER_TYPES", "Cancel", "ChatMessage", "Chunk",
    "Done", "Error", "ErrorCode", "Generate", "Health", "HealthReply", "Message", "ProposerStats",
    "ProtocolError", "ScorerStats", "SpecOptions", "SpecUsage", "StartupStats", "Stats", "StatsReply",
    "Usage",
]  # fmt: skip
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
class StartupStats:
    """The daemon's start-up: seconds from its process's start to each milestone, in the order reached
    (null: not part of this start). The engine's ``StartupTimes`` (specsched.engine.warmup) on the wire."""

    clock: str = "proc"  # proc: from the process's start (/proc); main: from the entry point's first line
    conversion: str = "none"  # the weights' conversion cache: hit | built | none (nothing to convert)
    imports_s: float | None = None
    config_s: float | None = None
    weights_s: float | None = None
    tokenizer_s: float | None = None
    draft_s: float | None = None
    prebuild_s: float | None = None
    kv_cache_s: float | None = None
    graphs_s: float | None = None
    warmup_s: float | None = None
    log_s: float | None = None
    listening_s: float | None = None  # the whole start-up


@dataclass
class HostStats:
    """The kernel's counters for the daemon's process and engine thread (daemon/host_stats.py; null:
    not on this platform): what may make one daemon's host slower than another's."""

    engine_voluntary_switches: int | None = None  # the engine thread's own waits (GPU, lock, queue)
    engine_nonvoluntary_switches: int | None = None  # its CPU taken away by another thread or process
    engine_last_cpu: int | None = None  # the CPU it last ran on
    anon_huge_pages_bytes: int | None = None  # the process's anonymous memory in transparent huge pages
    num_threads: int | None = None  # the process's threads
    # CPU seconds so far (/proc schedstat: ns on a CPU): the engine, IO and log-writer threads, the
    # engine thread's seconds runnable but waiting for a CPU, and the whole process (time.process_time)
    engine_cpu_s: float | None = None
    engine_runqueue_s: float | None = None
    io_cpu_s: float | None = None
    log_cpu_s: float | None = None
    process_cpu_s: float | None = None


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
    num_kernels_built_at_start: int = 0  # Triton kernel variants built before the daemon listened
    num_compiles_after_start: int = 0  # Triton variants built while serving (a stall each; 0 = warm)
    startup: StartupStats | None = None  # the start-up's breakdown (null: the server did not time it)
    host: HostStats | None = None  # the process's and engine thread's kernel counters (null: not Linux)


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
