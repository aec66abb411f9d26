"""Client library for the specsched daemon (protocol v1, docs/protocol.md).

``Client`` (blocking, pyzmq) and ``AsyncClient`` (zmq.asyncio) share one DEALER socket per client and
keep many requests in flight on it: replies are routed by request id (``AsyncClient``: one reader
task; ``Client``: replies for other ids are buffered until asked for). Errors are typed:
:class:`ServerError` subclasses carry the server's ``code``; :class:`RequestTimeout` (a
``TimeoutError``) when no reply came within ``timeout_s``; :class:`ConnectionLost` when the connection
to the daemon dropped while the request was in flight (the daemon aborts such requests).

ZeroMQ reconnects by itself: after the daemon restarts, the same client serves new requests (those in
flight when it went away raised :class:`ConnectionLost`). ``reconnect()`` starts over on a fresh socket
(a new identity; everything pending fails with :class:`ConnectionLost`). ``curve=CurveKeys(...)``
talks to a daemon that requires CURVE (docs/operations.md).

    with Client("tcp://127.0.0.1:5555") as c:
        print(c.generate("Hello", max_tokens=16).text)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import operator
import struct
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from specsched.daemon.auth import CurveKeys
from specsched.daemon.protocol import (
    MAX_ID_CHARS,
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
    Message,
    ProtocolError,
    SpecOptions,
    SpecUsage,
    Stats,
    StatsReply,
    Usage,
    decode,
    encode,
)

logger = logging.getLogger(__name__)
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"


# ---- errors ----------------------------------------------------------------------------------------


class SpecschedError(Exception):
    """Base of the client's errors: ``code`` (a protocol error code or a client-side one) and ``message``."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.request_id = code, message, request_id


class ServerError(SpecschedError):
    """An ``error`` reply from the daemon; the subclass names the code."""

    CODE: str = ""


def _error_class(name: str, code: ErrorCode) -> type[ServerError]:
    return type(name, (ServerError,), {"CODE": code.value, "__module__": __name__, "__qualname__": name})


BadMessage = _error_class("BadMessage", ErrorCode.BAD_MESSAGE)
UnknownType = _error_class("UnknownType", ErrorCode.UNKNOWN_TYPE)
InvalidField = _error_class("InvalidField", ErrorCode.INVALID_FIELD)
DuplicateId = _error_class("DuplicateId", ErrorCode.DUPLICATE_ID)
PromptTooLong = _error_class("PromptTooLong", ErrorCode.PROMPT_TOO_LONG)
UnknownProposer = _error_class("UnknownProposer", ErrorCode.UNKNOWN_PROPOSER)
UnknownId = _error_class("UnknownId", ErrorCode.UNKNOWN_ID)
Overloaded = _error_class("Overloaded", ErrorCode.OVERLOADED)
TooManyInflight = _error_class("TooManyInflight", ErrorCode.TOO_MANY_INFLIGHT)
ShuttingDown = _error_class("ShuttingDown", ErrorCode.SHUTTING_DOWN)
InternalError = _error_class("InternalError", ErrorCode.INTERNAL)
SERVER_ERRORS: dict[str, type[ServerError]] = {c.CODE: c for c in ServerError.__subclasses__()}


class RequestTimeout(SpecschedError, TimeoutError):
    """No reply within ``timeout_s`` (the request is cancelled on the daemon)."""


class ConnectionLost(SpecschedError, ConnectionError):
    """The connection dropped (or the client was closed or reconnected) while the request was in flight."""


class AuthenticationFailed(ConnectionLost):
    """The CURVE handshake failed: this client's key is not allowed, the server key is wrong, or one
    side uses CURVE and the other does not. The daemon never saw the request."""


_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the daemon refused this client's CURVE key (not allowed) "
    "or the server key is wrong",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed: the daemon requires CURVE "
    "(pass curve=CurveKeys(...)), or this client uses CURVE and the daemon does not",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed (a CURVE mismatch, or not a specsched daemon)",
}
_MONITORED = zmq.EVENT_DISCONNECTED | functools.reduce(operator.or_, _HANDSHAKE_FAILED)


def _connection_error(event: int, rid: str | None) -> ConnectionLost:
    """The error for requests pending when the monitor reported ``event``."""
    if event in _HANDSHAKE_FAILED:
        return AuthenticationFailed("auth_failed", _HANDSHAKE_FAILED[event], rid)
    return ConnectionLost("connection_lost", "the connection to the daemon dropped", rid)


class MessageTooLarge(SpecschedError, ValueError):
    """The encoded message exceeds ``max_message_bytes`` (the daemon's ZeroMQ would drop it and close
    the connection); nothing was sent."""


def server_error(err: Error) -> ServerError:
    return SERVER_ERRORS.get(err.code, ServerError)(err.code, err.message, err.id)


# ---- results ---------------------------------------------------------------------------------------


@dataclass
class Completion:
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort | timeout | error
    usage: Usage = field(default_factory=Usage)
    spec: SpecUsage = field(default_factory=SpecUsage)


def _generate_msg(stream: bool, prompt, prompt_ids, messages, max_tokens, temperature, top_p, top_k, seed,
                  stop, spec, id, timeout=None) -> Generate:  # fmt: skip
    rid = uuid.uuid4().hex if id is None else id
    if not isinstance(rid, str) or not 1 <= len(rid) <= MAX_ID_CHARS:
        raise ValueError(f"id must be a string of 1..{MAX_ID_CHARS} characters, got {rid!r}")
    if messages is not None:
        messages = [
            m if isinstance(m, ChatMessage) else ChatMessage(m["role"], m["content"]) for m in messages
        ]
    if isinstance(spec, dict):
        spec = SpecOptions(**spec)
    return Generate(rid, prompt, prompt_ids, messages, max_tokens, temperature, top_p, top_k, seed,
                    list(stop or []), stream, spec or SpecOptions(), timeout)  # fmt: skip


class _Base:
    def __init__(
        self,
        endpoint: str,
        timeout_s: float,
        max_message_bytes: int,
        ctx: zmq.Context,
        curve: CurveKeys | None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if curve is not None and not isinstance(curve, CurveKeys):
            raise TypeError(f"curve must be a CurveKeys, got {type(curve).__name__}")
        self.endpoint, self.timeout_s, self.max_message_bytes = endpoint, timeout_s, max_message_bytes
        self.curve = curve
        self._ctx = ctx
        self._is_closed = False
        try:
            self._open_socket()
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot connect to {endpoint!r}: {e}") from e

    def _open_socket(self) -> None:
        self._sock = self._monitor = None
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 5000)  # a daemon that stopped answering counts as gone
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15000)
        self._sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1e3))  # never block forever on a send
        if self.curve is not None:
            self.curve.apply(self._sock)
        self._monitor = self._sock.get_monitor_socket(_MONITORED)
        self._sock.connect(self.endpoint)

    def _close_socket(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        if self._sock is not None:
            self._sock.close(linger=0)

    def _encode(self, msg: Message) -> bytes:
        if self._is_closed:
            raise ConnectionLost("closed", "the client is closed", getattr(msg, "id", None))
        data = encode(msg)
        if len(data) > self.max_message_bytes:  # the daemon's ZMQ would drop it and disconnect us
            raise MessageTooLarge(
                "message_too_large",
                f"{len(data)} bytes > max_message_bytes {self.max_message_bytes}",
                getattr(msg, "id", None),
            )
        return data

    def _send_timeout(self, rid: str | None) -> RequestTimeout:
        return RequestTimeout("timeout", f"could not queue a message within {self.timeout_s} s", rid)

    @staticmethod
    def _event(frames: list[bytes]) -> int:
        return struct.unpack("=H", frames[0][:2])[0]

    def _close_sockets(self) -> None:
        self._is_closed = True
        self._close_socket()
        self._ctx.term()

    @staticmethod
    def _completion(msg: Done, text: str | None = None, token_ids: list[int] | None = None) -> Completion:
        text = msg.text if text is None else text
        token_ids = msg.token_ids if token_ids is None else token_ids
        return Completion(msg.id, text or "", list(token_ids or []), msg.finish_reason, msg.usage, msg.spec)


# ---- blocking client -------------------------------------------------------------------------------


class Client(_Base):
    """Blocking client. Not thread-safe: use one per thread (or :class:`AsyncClient`)."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout_s: float = 60.0,
        max_message_bytes: int = 1 << 20,
        curve: CurveKeys | None = None,
    ):
        super().__init__(endpoint, timeout_s, max_message_bytes, zmq.Context(), curve)
        self._register()
        self._buffers: dict[str, deque[Message]] = {}
        self._pending: set[str] = set()  # ids with replies still to come
        self._lost: dict[str, int] = {}  # pending ids whose connection dropped -> the monitor event
        self._abandoned: set[str] = set()  # ids whose remaining replies are dropped
        self._to_cancel: list[str] = []  # abandoned by a garbage-collected stream; cancelled at the next call

    def generate(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                 messages: list[dict] | None = None, max_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
                 spec: SpecOptions | dict | None = None, id: str | None = None,
                 timeout: float | None = None) -> Completion:  # fmt: skip
        """Run one request to completion (``stream=false`` on the wire). ``timeout``: the daemon ends
        the request after this many seconds (finish_reason ``timeout``, with what it had produced)."""
        msg = _generate_msg(False, prompt, prompt_ids, messages, max_tokens, temperature, top_p, top_k,
                            seed, stop, spec, id, timeout)  # fmt: skip
        self._submit(msg)
        return self._completion(self._final(msg.id, Done))

    def stream(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
               messages: list[dict] | None = None, max_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
               spec: SpecOptions | dict | None = None, id: str | None = None,
               timeout: float | None = None) -> ChunkStream:  # fmt: skip
        """Send a streaming request; iterate the returned :class:`ChunkStream` for its chunks."""
        msg = _generate_msg(True, prompt, prompt_ids, messages, max_tokens, temperature, top_p, top_k,
                            seed, stop, spec, id, timeout)  # fmt: skip
        self._submit(msg)
        return ChunkStream(self, msg.id)

    def cancel(self, id: str) -> None:
        """Ask the daemon to abort request ``id``; its ``done`` (finish_reason ``abort``) still arrives."""
        self._send(self._encode(Cancel(id)), id)

    def stats(self) -> StatsReply:
        return self._final(self._submit(Stats(uuid.uuid4().hex)).id, StatsReply)

    def health(self) -> HealthReply:
        return self._final(self._submit(Health(uuid.uuid4().hex)).id, HealthReply)

    def close(self) -> None:
        if not self._is_closed:
            self._close_sockets()

    def reconnect(self) -> None:
        """Start over on a fresh socket (a new identity to the daemon): every request still pending
        raises :class:`ConnectionLost` when next waited on; the daemon aborts them when it notices."""
        if self._is_closed:
            raise ConnectionLost("closed", "the client is closed")
        self._lost.update(dict.fromkeys(self._pending - set(self._lost), zmq.EVENT_DISCONNECTED))
        self._buffers.clear()
        self._abandoned.clear()
        self._to_cancel.clear()
        self._close_socket()
        self._open_socket()
        self._register()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------------
    def _register(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _send(self, data: bytes, rid: str | None) -> None:
        try:
            self._sock.send(data)
        except zmq.Again:  # SNDTIMEO: the queue to the daemon stayed full (it is gone or stuck)
            raise self._send_timeout(rid) from None

    def _drain_monitor(self) -> None:
        """Connection events concern the requests pending now (the first event names the cause)."""
        while self._monitor.poll(0):
            event = self._event(self._monitor.recv_multipart())
            for pending in self._pending:
                self._lost.setdefault(pending, event)

    def _submit(self, msg: Generate | Stats | Health):
        self._send_deferred_cancels()
        self._drain_monitor()  # events from before this request are not about it
        if msg.id in self._pending:
            raise DuplicateId(ErrorCode.DUPLICATE_ID.value, f"id {msg.id!r} is already in flight", msg.id)
        data = self._encode(msg)
        self._send(data, msg.id)
        self._pending.add(msg.id)
        self._lost.pop(msg.id, None)  # an id reused after reconnect()
        return msg

    def _final(self, rid: str, kind: type):
        """Wait for ``rid``'s reply of type ``kind`` (raising an error reply)."""
        reply = self._next(rid)
        if not isinstance(reply, kind):
            self._pending.discard(rid)
            if isinstance(reply, Error):
                raise server_error(reply)
            raise SpecschedError("bad_reply", f"expected {kind.TYPE} for {rid!r}, got {reply.TYPE}", rid)
        self._pending.discard(rid)
        return reply

    def _abandon(self, rid: str, defer: bool = False) -> None:
        """Drop ``rid``'s remaining replies and cancel it (after a timeout or an early close; deferred
        to the next call when a stream object is garbage-collected unfinished)."""
        if rid not in self._pending:
            return
        self._pending.discard(rid)
        self._buffers.pop(rid, None)
        self._abandoned.add(rid)
        self._to_cancel.append(rid)
        if not defer:
            self._send_deferred_cancels()

    def _send_deferred_cancels(self) -> None:
        while self._to_cancel and not self._is_closed:
            self.cancel(self._to_cancel.pop())

    def _next(self, rid: str) -> Message:
        """The next message for ``rid``; messages for other ids are buffered."""
        self._send_deferred_cancels()
        deadline = time.monotonic() + self.timeout_s
        while True:
            buf = self._buffers.get(rid)
            if buf:
                msg = buf.popleft()
                if not buf:
                    del self._buffers[rid]
                return msg
            if rid in self._lost:
                self._pending.discard(rid)
                raise _connection_error(self._lost.pop(rid), rid)
            if self._is_closed:
                raise ConnectionLost("closed", "the client is closed", rid)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._abandon(rid)
                raise RequestTimeout("timeout", f"no reply for {rid!r} within {self.timeout_s} s", rid)
            events = dict(self._poller.poll(remaining * 1e3))
            if self._monitor in events:
                self._drain_monitor()
            if self._sock in events:
                while self._sock.poll(0):
                    self._route(self._sock.recv())

    def _route(self, frame: bytes) -> None:
        try:
            msg = decode(frame, allowed=SERVER_TYPES)
        except ProtocolError as e:
            logger.warning("dropping an unreadable reply from the daemon: %s", e)
            return
        if msg.id is None:
            logger.warning("daemon error without a request id: %s: %s", msg.code, msg.message)
        elif msg.id in self._abandoned:
            if isinstance(msg, (Done, Error)):
                self._abandoned.discard(msg.id)
        elif msg.id in self._pending:
            self._buffers.setdefault(msg.id, deque()).append(msg)


class ChunkStream:
    """The chunks of one streaming request. After iteration, ``done`` is the ``done`` message and
    ``completion`` the assembled result. ``close()`` (or leaving a ``with`` block) before the end
    cancels the request."""

    def __init__(self, client: Client, rid: str) -> None:
        self.client, self.id = client, rid
        self.done: Done | None = None
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._is_open = True
        # dropped unfinished (e.g. ``break`` out of the loop): cancel it rather than buffer its replies
        self._finalizer = weakref.finalize(self, client._abandon, rid, True)

    def __iter__(self) -> ChunkStream:
        return self

    def __next__(self) -> Chunk:
        if not self._is_open:
            raise StopIteration
        try:
            msg = self.client._next(self.id)
        except Exception:
            self._is_open = False
            self._finalizer.detach()
            raise
        if isinstance(msg, Chunk):
            self._text.append(msg.text)
            self._token_ids.extend(msg.token_ids)
            return msg
        self._is_open = False
        self._finalizer.detach()
        self.client._pending.discard(self.id)
        if isinstance(msg, Done):
            self.done = msg
            raise StopIteration
        if isinstance(msg, Error):
            raise server_error(msg)
        raise SpecschedError("bad_reply", f"unexpected {msg.TYPE} in the stream of {self.id!r}", self.id)

    @property
    def completion(self) -> Completion | None:
        return (
            None if self.done is None else Client._completion(self.done, "".join(self._text), self._token_ids)
        )

    def close(self) -> None:
        if self._is_open:
            self._is_open = False
            self._finalizer.detach()
            self.client._abandon(self.id)

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- asyncio client --------------------------------------------------------------------------------

_LOST = object()  # queue marker: connection dropped / client closed


class AsyncClient(_Base):
    """asyncio client (zmq.asyncio): any number of concurrent requests on one socket; one reader
    task routes replies to per-request queues. Create and use it inside one event loop."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout_s: float = 60.0,
        max_message_bytes: int = 1 << 20,
        curve: CurveKeys | None = None,
    ):
        super().__init__(endpoint, timeout_s, max_message_bytes, zmq.asyncio.Context(), curve)
        self._queues: dict[str, asyncio.Queue] = {}  # requests awaiting replies
        self._reader: asyncio.Task | None = None
        self._to_cancel: list[str] = []  # left before their last reply; cancelled at the next call

    async def generate(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                       messages: list[dict] | None = None, max_tokens: int = 64, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                       stop: list[str] | None = None, spec: SpecOptions | dict | None = None,
                       id: str | None = None, timeout: float | None = None) -> Completion:  # fmt: skip
        msg = _generate_msg(False, prompt, prompt_ids, messages, max_tokens, temperature, top_p, top_k,
                            seed, stop, spec, id, timeout)  # fmt: skip
        queue = await self._submit(msg)
        try:
            return self._completion(await self._final(msg.id, queue, Done))
        finally:
            self._forget(msg.id)

    def stream(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
               messages: list[dict] | None = None, max_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
               spec: SpecOptions | dict | None = None, id: str | None = None,
               timeout: float | None = None) -> AsyncChunkStream:  # fmt: skip
        """``async for chunk in client.stream(...)``; the request is sent at the first iteration."""
        msg = _generate_msg(True, prompt, prompt_ids, messages, max_tokens, temperature, top_p, top_k,
                            seed, stop, spec, id, timeout)  # fmt: skip
        return AsyncChunkStream(self, msg)

    async def cancel(self, id: str) -> None:
        await self._send(self._encode(Cancel(id)), id)

    async def stats(self) -> StatsReply:
        msg = Stats(uuid.uuid4().hex)
        try:
            return await self._final(msg.id, await self._submit(msg), StatsReply)
        finally:
            self._queues.pop(msg.id, None)

    async def health(self) -> HealthReply:
        msg = Health(uuid.uuid4().hex)
        try:
            return await self._final(msg.id, await self._submit(msg), HealthReply)
        finally:
            self._queues.pop(msg.id, None)

    async def close(self) -> None:
        if self._is_closed:
            return
        await self._stop_reader()
        self._close_sockets()

    async def reconnect(self) -> None:
        """Start over on a fresh socket (a new identity): requests pending raise :class:`ConnectionLost`."""
        if self._is_closed:
            raise ConnectionLost("closed", "the client is closed")
        await self._stop_reader()
        self._to_cancel.clear()
        self._close_socket()
        self._open_socket()

    async def _stop_reader(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
            self._reader = None
        for q in self._queues.values():
            q.put_nowait(_LOST)
        self._queues.clear()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- internals --------------------------------------------------------------------------------
    async def _submit(self, msg) -> asyncio.Queue:
        while self._to_cancel and not self._is_closed:
            await self.cancel(self._to_cancel.pop())
        if msg.id in self._queues:
            raise DuplicateId(ErrorCode.DUPLICATE_ID.value, f"id {msg.id!r} is already in flight", msg.id)
        data = self._encode(msg)
        if self._reader is None:
            while await self._monitor.poll(0):  # events from before the reader ran concern no request
                await self._monitor.recv_multipart()
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        queue = self._queues[msg.id] = asyncio.Queue()
        try:
            await self._send(data, msg.id)
        except BaseException:
            self._queues.pop(msg.id, None)
            raise
        return queue

    async def _send(self, data: bytes, rid: str | None) -> None:
        try:
            await asyncio.wait_for(self._sock.send(data), self.timeout_s)
        except (asyncio.TimeoutError, zmq.Again):  # the queue to the daemon stayed full
            raise self._send_timeout(rid) from None

    async def _next(self, rid: str, queue: asyncio.Queue) -> Message:
        try:
            msg = await asyncio.wait_for(queue.get(), self.timeout_s)
        except asyncio.TimeoutError:
            self._queues.pop(rid, None)
            if not self._is_closed:
                await self.cancel(rid)
            raise RequestTimeout("timeout", f"no reply for {rid!r} within {self.timeout_s} s", rid) from None
        if msg is _LOST:
            self._queues.pop(rid, None)
            code = "closed" if self._is_closed else "connection_lost"
            raise ConnectionLost(code, "the connection to the daemon dropped or the client was closed", rid)
        if isinstance(msg, int):  # a monitor event
            self._queues.pop(rid, None)
            raise _connection_error(msg, rid)
        return msg

    def _forget(self, rid: str) -> None:
        """``rid`` is left before its last reply (task cancelled, stream dropped): stop routing its
        replies and cancel it on the daemon at the next call."""
        if self._queues.pop(rid, None) is not None:
            self._to_cancel.append(rid)

    async def _final(self, rid: str, queue: asyncio.Queue, kind: type):
        reply = await self._next(rid, queue)
        self._queues.pop(rid, None)
        if isinstance(reply, kind):
            return reply
        if isinstance(reply, Error):
            raise server_error(reply)
        raise SpecschedError("bad_reply", f"expected {kind.TYPE} for {rid!r}, got {reply.TYPE}", rid)

    async def _read_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            events = dict(await poller.poll())
            if self._monitor in events:
                event = self._event(await self._monitor.recv_multipart())
                for q in self._queues.values():
                    q.put_nowait(event)
                self._queues.clear()
            if self._sock in events:
                while await self._sock.poll(0):
                    self._route(await self._sock.recv())

    def _route(self, frame: bytes) -> None:
        try:
            msg = decode(frame, allowed=SERVER_TYPES)
        except ProtocolError as e:
            logger.warning("dropping an unreadable reply from the daemon: %s", e)
            return
        if msg.id is None:
            logger.warning("daemon error without a request id: %s: %s", msg.code, msg.message)
            return
        queue = self._queues.get(msg.id)
        if queue is not None:  # else: abandoned (timed out / closed early)
            queue.put_nowait(msg)


class AsyncChunkStream:
    """Async iterator over one streaming request's chunks; ``done`` / ``completion`` after the end;
    ``await aclose()`` (or ``async with``) before the end cancels the request."""

    def __init__(self, client: AsyncClient, msg: Generate) -> None:
        self.client, self.msg, self.id = client, msg, msg.id
        self.done: Done | None = None
        self._queue: asyncio.Queue | None = None
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._is_open = True

    def __aiter__(self) -> AsyncChunkStream:
        return self

    async def __anext__(self) -> Chunk:
        if not self._is_open:
            raise StopAsyncIteration
        if self._queue is None:
            self._queue = await self.client._submit(self.msg)
            self._finalizer = weakref.finalize(self, self.client._forget, self.id)
        try:
            msg = await self.client._next(self.id, self._queue)
        except Exception:
            self._is_open = False
            self._finalizer.detach()
            raise
        if isinstance(msg, Chunk):
            self._text.append(msg.text)
            self._token_ids.extend(msg.token_ids)
            return msg
        self._is_open = False
        self._finalizer.detach()
        self.client._queues.pop(self.id, None)
        if isinstance(msg, Done):
            self.done = msg
            raise StopAsyncIteration
        if isinstance(msg, Error):
            raise server_error(msg)
        raise SpecschedError("bad_reply", f"unexpected {msg.TYPE} in the stream of {self.id!r}", self.id)

    @property
    def completion(self) -> Completion | None:
        return (
            None if self.done is None else _Base._completion(self.done, "".join(self._text), self._token_ids)
        )

    async def aclose(self) -> None:
        if self._is_open:
            self._is_open = False
            if self._queue is not None:
                self._finalizer.detach()
                if self.client._queues.pop(self.id, None) is not None and not self.client._is_closed:
                    await self.client.cancel(self.id)

    async def __aenter__(self) -> AsyncChunkStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
