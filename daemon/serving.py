"""The engine thread's side of the daemon: wire requests in, ``chunk`` / ``done`` messages out.

The IO thread (server.py) hands over commands (:class:`Admit`, :class:`CancelRequest`,
:class:`DropClient`, :class:`Shutdown`) through a queue; :class:`Serving` drains them between engine
steps (continuous batching), tokenizes prompts (chat template for ``messages``), detokenizes outputs
incrementally, applies stop strings (the engine handles EOS / stop ids / length), and turns each
step's :class:`RequestOutput` s into messages for the IO thread as soon as the step ends. It also
enforces the limits that need the tokenizer or the engine (prompt / output length, the KV cache's
capacity, the queue) and each request's deadline (``generate.timeout``, ``daemon.request_timeout_s``).
"""

from __future__ import annotations

import heapq
import logging
import queue
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specsched.daemon.protocol import (
    Chunk,
    Done,
    Error,
    ErrorCode,
    Generate,
    Message,
    ProposerStats,
    ProtocolError,
    ScorerStats,
    SpecUsage,
    StatsReply,
    Usage,
)
from specsched.daemon.records import RequestOutput, StepRecord
from specsched.daemon.request import FinishReason, Request, SamplingParams, SpecParams
from specsched.models.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


@dataclass
class Admit:
    client: bytes  # ZMQ routing identity
    msg: Generate
    arrival_time: float  # time.time() when the IO thread received it
    received: float = field(default_factory=time.monotonic)  # the same moment; deadlines count from it


@dataclass
class CancelRequest:
    client: bytes
    id: str


@dataclass
class DropClient:
    """The client is unreachable: abort its requests without replying."""

    client: bytes


@dataclass
class Shutdown:
    grace_s: float  # let in-flight requests run this long, then abort the rest


Command = Admit | CancelRequest | DropClient | Shutdown


class StepStats:
    """Counters for ``stats`` from the engine's step records: output tokens/s over a recent window,
    acceptance per proposer (decode steps), mean step and score time per scorer."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.started = time.monotonic()
        self._recent: deque[tuple[float, int]] = deque()  # (monotonic time, tokens emitted)
        self.proposed: dict[str, int] = defaultdict(int)
        self.accepted: dict[str, int] = defaultdict(int)
        self.scorer_steps: dict[str, int] = defaultdict(int)
        self.scorer_step_ms: dict[str, float] = defaultdict(float)
        self.scorer_score_ms: dict[str, float] = defaultdict(float)

    def observe(self, rec: StepRecord) -> None:
        self._recent.append((time.monotonic(), rec.num_emitted))
        if rec.kind != "decode":
            return
        if rec.proposer:
            self.proposed[rec.proposer] += rec.num_proposed
            self.accepted[rec.proposer] += rec.num_accepted
        if rec.scorer:
            self.scorer_steps[rec.scorer] += 1
            self.scorer_step_ms[rec.scorer] += rec.total_ms
            self.scorer_score_ms[rec.scorer] += rec.score_ms

    def tokens_per_s(self) -> float:
        """Tokens emitted in the last ``window_s`` seconds / the window (shorter right after start)."""
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        span = min(self.window_s, max(now - self.started, 1e-3))
        return sum(n for _, n in self._recent) / span

    def proposers(self) -> dict[str, ProposerStats]:
        return {
            p: ProposerStats(n, self.accepted[p], self.accepted[p] / n if n else 0.0)
            for p, n in self.proposed.items()
        }

    def scorers(self) -> dict[str, ScorerStats]:
        return {
            s: ScorerStats(n, self.scorer_step_ms[s] / n, self.scorer_score_ms[s] / n)
            for s, n in self.scorer_steps.items()
        }


@dataclass
class _Stream:
    """One admitted request as the daemon tracks it (text, stop strings, what was sent)."""

    client: bytes
    id: str  # the client's id
    key: str  # the engine's request id (unique across clients)
    is_streaming: bool
    stop: list[str]
    num_prompt_tokens: int
    arrival_time: float
    detok: IncrementalDetokenizer | None
    deadline: float | None = None  # time.monotonic() after which it finishes with "timeout"
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # all text so far (cut before a stop string)
    num_sent_chars: int = 0
    is_stopped: bool = False  # a stop string matched
    first_token_time: float | None = None
    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    def advance(self, new_ids: list[int], finishing: bool) -> tuple[str, bool]:
        """Take new ids; return (text to send now, whether a stop string matched). Until the request
        finishes, the last ``max(len(stop)) - 1`` characters are held back: they may start a stop
        string that later tokens complete, and text after a stop string is never sent."""
        self.token_ids.extend(new_ids)
        if self.detok is None or self.is_stopped:
            return "", self.is_stopped
        old_len = len(self.text)
        self.text += self.detok.push(new_ids) + (self.detok.flush() if finishing else "")
        if self.stop and len(self.text) > old_len:
            start = max(0, old_len - max(map(len, self.stop)) + 1)
            hits = [p for p in (self.text.find(s, start) for s in self.stop) if p >= 0]
            if hits:
                self.text, self.is_stopped = self.text[: min(hits)], True
        if finishing or self.is_stopped or not self.stop:
            end = len(self.text)
        else:
            end = max(self.num_sent_chars, len(self.text) - max(map(len, self.stop)) + 1)
        out, self.num_sent_chars = self.text[self.num_sent_chars : end], end
        return out, self.is_stopped


def _engine_counters(engine) -> dict:
    """The engine's own counters (``stats()`` in the API notes; an ``EngineStats`` with ``to_dict``
    in the implementation), with values made msgpack-safe."""
    stats = getattr(engine, "stats", None)
    raw = stats() if callable(stats) else stats.to_dict() if stats is not None else {}

    def plain(v):
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)

    return plain(raw)


class Serving:
    """Runs on the engine thread; owns the engine. ``send(client, msg)`` queues a message for the IO
    thread, ``flush()`` wakes it (called once per loop iteration, after the step's messages)."""

    def __init__(
        self, engine, cfg, send: Callable[[bytes, Message], None], flush: Callable[[], None], log=None
    ) -> None:
        self.engine, self.cfg, self.send, self.flush, self.log = engine, cfg, send, flush, log
        self.streams: dict[str, _Stream] = {}  # engine request id -> stream
        self.by_client: dict[bytes, set[str]] = defaultdict(set)
        self.step_stats = StepStats(cfg.stats_window_s)
        self.counts = {"done": 0, "aborted": 0, "errored": 0, "rejected": 0, "timed_out": 0}
        self.deadlines: list[tuple[float, str]] = []  # heap of (deadline, stream key)
        self.snapshot = StatsReply()  # replaced (not mutated) after every loop iteration
        self._deadline: float | None = None  # shutdown: abort what is left at this monotonic time
        self._is_log_broken = False
        self._chained_on_step = None  # an on_step callback the engine had before serving started

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self, inbox: queue.Queue) -> None:
        """Drain commands, step, publish; returns once a :class:`Shutdown` has been carried out."""
        idle_s = self.cfg.idle_sleep_ms / 1e3
        self._chained_on_step, self.engine.on_step = self.engine.on_step, self._on_step
        while True:
            is_idle = not self.engine.has_unfinished and self._deadline is None
            try:
                self._handle_safely(inbox.get(timeout=idle_s) if is_idle else inbox.get_nowait())
                while True:
                    self._handle_safely(inbox.get_nowait())
            except queue.Empty:
                pass
            if self._deadline is not None and (
                not self.engine.has_unfinished or time.monotonic() >= self._deadline
            ):
                self.abort_all(FinishReason.ABORT)
                self.publish()
                self.flush()
                return
            self.expire()
            if self.engine.has_unfinished:
                self.step()
            self.publish()
            self.flush()

    def _handle_safely(self, cmd: Command) -> None:
        try:
            self.handle(cmd)
        except Exception:  # noqa: BLE001 -- one bad command must not stop the engine thread
            logger.exception("handling %s failed", type(cmd).__name__)

    def handle(self, cmd: Command) -> None:
        if isinstance(cmd, Admit):
            self.admit(cmd)
        elif isinstance(cmd, CancelRequest):
            st = self.streams.get(_key(cmd.client, cmd.id))
            if st is not None:  # else it finished meanwhile; its done is on the way
                self.engine.abort_request(st.key, FinishReason.ABORT)
                self._finish(st, FinishReason.ABORT.value)
        elif isinstance(cmd, DropClient):
            for key in list(self.by_client.get(cmd.client, ())):
                self.engine.abort_request(key, FinishReason.ABORT)
                self._finish(self.streams[key], FinishReason.ABORT.value, reply=False)
        elif isinstance(cmd, Shutdown):
            deadline = time.monotonic() + cmd.grace_s
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 -- a failed step fails its requests, not the daemon
            logger.exception("engine step failed; failing all %d in-flight requests", len(self.streams))
            self.abort_all(FinishReason.ERROR, error=f"engine step failed: {type(e).__name__}: {e}")
            return
        for out in outputs:
            self._on_output(out)

    def expire(self) -> None:
        """Finish every request whose deadline passed (``done`` with finish_reason ``timeout``)."""
        now = time.monotonic()
        while self.deadlines and self.deadlines[0][0] <= now:
            _, key = heapq.heappop(self.deadlines)
            st = self.streams.get(key)
            if st is not None and st.deadline is not None and st.deadline <= now:  # not a reused key
                self.engine.abort_request(key, FinishReason.TIMEOUT)
                self._finish(st, FinishReason.TIMEOUT.value)

    def publish(self) -> None:
        e, c = self.engine, self.counts
        self.snapshot = StatsReply(
            num_waiting=e.num_waiting,
            num_running=e.num_running,
            num_inflight=len(self.streams),
            num_free_blocks=e.num_free_blocks,
            num_total_blocks=e.num_total_blocks,
            tokens_per_s=self.step_stats.tokens_per_s(),
            num_requests_done=c["done"],
            num_requests_aborted=c["aborted"],
            num_requests_errored=c["errored"],
            num_requests_rejected=c["rejected"],
            proposers=self.step_stats.proposers(),
            scorers=self.step_stats.scorers(),
            engine=_engine_counters(e),
            num_requests_timed_out=c["timed_out"],
            num_preemptions=int(getattr(getattr(e, "scheduler", None), "num_preemptions", 0)),
        )

    def abort_all(self, reason: FinishReason, error: str | None = None) -> None:
        for st in list(self.streams.values()):
            try:
                self.engine.abort_request(st.key, reason)
            except Exception:  # noqa: BLE001 -- the engine may be broken; still answer the client
                logger.exception("aborting %s failed", st.key)
            self._finish(st, reason.value, error=error)

    # ---- admission --------------------------------------------------------------------------------
    def admit(self, cmd: Admit) -> None:
        msg = cmd.msg
        try:
            req = self._request(cmd)
            try:
                self.engine.add_request(req)
            except ValueError as e:
                raise _engine_error(e, msg.id) from None
        except Exception as e:  # noqa: BLE001 -- every request gets an answer
            if not isinstance(e, ProtocolError):
                logger.exception("admitting %r failed", msg.id)
                e = ProtocolError(ErrorCode.INTERNAL, f"admission failed: {type(e).__name__}: {e}", msg.id)
            self.counts["rejected"] += 1
            self.send(cmd.client, Error(msg.id, e.code.value, e.message))
            return
        tok = self.engine.tokenizer
        timeout = msg.timeout if msg.timeout is not None else self.cfg.request_timeout_s
        st = _Stream(
            cmd.client,
            msg.id,
            req.request_id,
            msg.stream,
            list(msg.stop),
            len(req.prompt_ids),
            cmd.arrival_time,
            IncrementalDetokenizer(tok) if tok is not None else None,
            deadline=None if timeout is None else cmd.received + timeout,
        )
        self.streams[st.key] = st
        if st.deadline is not None:
            heapq.heappush(self.deadlines, (st.deadline, st.key))
        self.by_client[cmd.client].add(st.key)

    def _request(self, cmd: Admit) -> Request:
        msg, tok, engine = cmd.msg, self.engine.tokenizer, self.engine
        if tok is None and (msg.prompt is not None or msg.messages is not None or msg.stop):
            name = "prompt" if msg.prompt is not None else "messages" if msg.messages is not None else "stop"
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"generate.{name}: this model has no tokenizer; send prompt_ids (and no stop strings)",
                msg.id,
            )
        try:
            if msg.prompt_ids is not None:
                ids = list(msg.prompt_ids)
            elif msg.prompt is not None:
                ids = tok.encode(msg.prompt)
            else:
                ids = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in msg.messages])
        except ValueError as e:
            field_name = "prompt" if msg.prompt is not None else "messages"
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"generate.{field_name}: {e}", msg.id) from None
        limit = min(self.cfg.max_prompt_tokens or engine.max_model_len, engine.max_model_len - 1)
        if len(ids) > limit:
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG,
                f"generate: the prompt has {len(ids)} tokens; this daemon takes at most {limit} "
                f"(context {engine.max_model_len}, prompt + output)",
                msg.id,
            )
        if not ids:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "generate.prompt: encodes to no tokens", msg.id)
        cap = self.cfg.max_output_tokens
        if cap is not None and msg.max_tokens > cap:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"generate.max_tokens: this daemon generates at most {cap} tokens per request "
                f"(daemon.max_output_tokens), got {msg.max_tokens}",
                msg.id,
            )
        # what the KV cache can hold for one request alone: beyond it the request could never finish
        # (preempted, it would wait forever for blocks that do not exist), so max_tokens is capped to it
        kv_slots = engine.num_total_blocks * engine.cfg.cache.block_size
        if len(ids) >= kv_slots:
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG,
                f"generate: the prompt has {len(ids)} tokens; the KV cache holds {kv_slots} "
                "(prompt + output)",
                msg.id,
            )
        known = getattr(engine, "proposers", None)
        if msg.spec.proposer is not None and known is not None and msg.spec.proposer not in known:
            raise ProtocolError(
                ErrorCode.UNKNOWN_PROPOSER,
                f"generate.spec.proposer: unknown proposer {msg.spec.proposer!r}; "
                f"known: {', '.join(sorted(known))}",
                msg.id,
            )
        if engine.num_waiting >= engine.cfg.scheduler.max_queue:
            raise ProtocolError(
                ErrorCode.OVERLOADED,
                f"the queue is full ({engine.num_waiting} waiting: scheduler.max_queue)",
                msg.id,
            )
        sampling = SamplingParams(
            temperature=msg.temperature,
            top_p=msg.top_p,
            top_k=msg.top_k,
            seed=msg.seed,
            max_tokens=min(msg.max_tokens, kv_slots - len(ids)),
            stop=list(msg.stop),
        )
        spec = SpecParams(max_k=msg.spec.max_k, proposer=msg.spec.proposer)
        return Request(
            _key(cmd.client, msg.id), ids, sampling, spec, arrival_time=cmd.arrival_time, client=cmd.client
        )

    # ---- outputs ----------------------------------------------------------------------------------
    def _on_step(self, rec: StepRecord) -> None:
        if self._chained_on_step is not None:
            self._chained_on_step(rec)
        self.step_stats.observe(rec)
        if self.log is not None:
            self._log_call(self.log.write_step, rec)

    def _on_output(self, out: RequestOutput) -> None:
        st = self.streams.get(out.request_id)
        if st is None:
            return
        reason = (
            None if out.finish_reason is None else str(getattr(out.finish_reason, "value", out.finish_reason))
        )
        text, is_hit = st.advance(list(out.new_token_ids), finishing=reason is not None)
        if out.new_token_ids:
            st.steps += 1
            st.first_token_time = st.first_token_time or time.time()
        st.proposed += out.num_proposed
        st.accepted += out.num_accepted
        if is_hit:
            if reason is None:
                self.engine.abort_request(st.key, FinishReason.STOP)
            reason = FinishReason.STOP.value
        if st.is_streaming and (out.new_token_ids or text):
            self.send(
                st.client, Chunk(st.id, list(out.new_token_ids), text, out.num_proposed, out.num_accepted)
            )
        if reason is not None:
            self._finish(st, reason)

    def _finish(self, st: _Stream, reason: str, reply: bool = True, error: str | None = None) -> None:
        text, _ = st.advance([], finishing=True)  # what was held back (nothing after a normal finish)
        if reply and error is not None:
            self.send(st.client, Error(st.id, ErrorCode.INTERNAL.value, error))
        elif reply:
            if st.is_streaming and text:
                self.send(st.client, Chunk(st.id, [], text))
            self.send(
                st.client,
                Done(
                    st.id,
                    reason,
                    Usage(st.num_prompt_tokens, len(st.token_ids)),
                    SpecUsage(st.proposed, st.accepted, st.steps),
                    text=None if st.is_streaming else st.text,
                    token_ids=None if st.is_streaming else list(st.token_ids),
                ),
            )
        kinds = {"stop": "done", "length": "done", "abort": "aborted", "timeout": "timed_out"}
        self.counts[kinds.get(reason, "errored")] += 1
        del self.streams[st.key]
        keys = self.by_client[st.client]
        keys.discard(st.key)
        if not keys:
            del self.by_client[st.client]
        if self.log is not None:
            self._log_call(
                self.log.write_request,
                st.key,
                client=st.client,
                arrival=st.arrival_time,
                first_token_time=st.first_token_time,
                finish_time=time.time(),
                prompt_tokens=st.num_prompt_tokens,
                output_tokens=len(st.token_ids),
                finish_reason=reason,
                proposed=st.proposed,
                accepted=st.accepted,
            )

    def _log_call(self, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 -- the log must never stop serving
            if not self._is_log_broken:
                self._is_log_broken = True
                logger.exception("decision log call failed (reported once)")


def _key(client: bytes, request_id: str) -> str:
    """The engine's request id: unique across clients (ids are only unique per client)."""
    return f"{client.hex()}:{request_id}"


def _engine_error(e: ValueError, request_id: str) -> ProtocolError:
    """Map a ValueError of ``Engine.add_request`` onto an error code (the checks above catch the
    common cases first; this is the fallback)."""
    text = str(e)
    if "proposer" in text:
        return ProtocolError(ErrorCode.UNKNOWN_PROPOSER, f"generate.spec.proposer: {text}", request_id)
    if "context" in text or "KV blocks" in text:
        return ProtocolError(ErrorCode.PROMPT_TOO_LONG, f"generate: {text}", request_id)
    if "token ids" in text:
        return ProtocolError(ErrorCode.INVALID_FIELD, f"generate.prompt_ids: {text}", request_id)
    return ProtocolError(ErrorCode.INVALID_FIELD, f"generate: {text}", request_id)
