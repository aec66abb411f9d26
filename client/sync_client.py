"""The blocking ``Client`` and the public names of the client library (protocol v1, docs/protocol.md).

``Client`` (blocking, pyzmq) and ``AsyncClient`` (asyncio; async_client.py) share one DEALER socket
per client and keep many requests in flight on it: replies are routed by request id (``AsyncClient``:
the event loop's reader callback; ``Client``: replies for other ids are buffered until asked for).
Both are thin shells around one sans-IO core (core.py: requests, reply routing, errors, reconnect
bookkeeping, stream assembly) and one transport (transport.py). Errors are typed (errors.py):
:class:`ServerError` subclasses carry the server's ``code``; :class:`RequestTimeout` (a
``TimeoutError``) when no reply came within ``timeout_s``; :class:`ConnectionLost` when the connection
to the daemon dropped while the request was in flight (the daemon aborts such requests).

ZeroMQ reconnects by itself: after the daemon restarts, the same client serves new requests (those in
flight when it went away raised :class:`ConnectionLost`). ``reconnect()`` starts over on a fresh socket
(a new identity; everything pending fails with :class:`ConnectionLost`). ``curve=CurveKeys(...)``
talks to a daemon that requires CURVE (docs/operations.md); ``context=`` a ZeroMQ context shared by
the process's clients (one IO thread for all; the client leaves it open).

    with Client("tcp://127.0.0.1:5555") as c:
        print(c.generate("Hello", max_tokens=16).text)
"""

from __future__ import annotations

import time
import uuid

import zmq

from specsched.client.async_client import AsyncChunkStream, AsyncClient
from specsched.client.core import Completion, StreamAssembly, build_generate, completion_of
from specsched.client.errors import (
    SERVER_ERRORS,
    AuthenticationFailed,
    BadMessage,
    ConnectionLost,
    DuplicateId,
    InternalError,
    InvalidField,
    MessageTooLarge,
    Overloaded,
    PromptTooLong,
    RequestTimeout,
    ServerError,
    ShuttingDown,
    SpecschedError,
    TooManyInflight,
    UnknownId,
    UnknownProposer,
    UnknownType,
    server_error,
)
from specsched.client.transport import DEFAULT_ENDPOINT, ClientSocket
from specsched.daemon.curve_keys import CurveKeys
from specsched.daemon.protocol import (  # the message types of this API (all importable from here)
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

__all__ = [
    "DEFAULT_ENDPOINT", "MAX_ID_CHARS", "SERVER_ERRORS", "SERVER_TYPES", "AsyncChunkStream", "AsyncClient",
    "AuthenticationFailed", "BadMessage", "Cancel", "ChatMessage", "Chunk", "ChunkStream", "Client",
    "Completion", "ConnectionLost", "CurveKeys", "Done", "DuplicateId", "Error", "ErrorCode", "Generate",
    "Health", "HealthReply", "InternalError", "InvalidField", "Message", "MessageTooLarge", "Overloaded",
    "PromptTooLong", "ProtocolError", "RequestTimeout", "ServerError", "ShuttingDown", "SpecOptions",
    "SpecUsage", "SpecschedError", "Stats", "StatsReply", "TooManyInflight", "UnknownId", "UnknownProposer",
    "UnknownType", "Usage", "decode", "encode", "server_error",
]  # fmt: skip


class Client(ClientSocket):
    """Blocking client. Not thread-safe: use one per thread (or :class:`AsyncClient`)."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout_s: float = 60.0,
        max_message_bytes: int = 1 << 20,
        curve: CurveKeys | None = None,
        context: zmq.Context | None = None,
    ):
        super().__init__(endpoint, timeout_s, max_message_bytes, context, curve)
        self._register()

    def generate(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                 messages: list[dict] | None = None, max_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
                 spec: SpecOptions | dict | None = None, id: str | None = None,
                 timeout: float | None = None) -> Completion:  # fmt: skip
        """Run one request to completion (``stream=false`` on the wire). ``timeout``: the daemon ends
        the request after this many seconds (finish_reason ``timeout``, with what it had produced)."""
        msg = build_generate(False, prompt, prompt_ids, messages, max_tokens, temperature, top_p, top_k,
                             seed, stop, spec, id, timeout)  # fmt: skip
        self._submit(msg)
        return completion_of(self._final(msg.id, Done))

    def stream(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
               messages: list[dict] | None = None, max_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
               spec: SpecOptions | dict | None = None, id: str | None = None,
               timeout: float | None = None) -> ChunkStream:  # fmt: skip
        """Send a streaming request; iterate the returned :class:`ChunkStream` for its chunks."""
        msg = build_generate(True, prompt, prompt_ids, messages, max_tokens, temperature, top_p, top_k,
                             seed, stop, spec, id, timeout)  # fmt: skip
        self._submit(msg)
        return ChunkStream(self, msg.id)

    def cancel(self, id: str) -> None:
        """Ask the daemon to abort request ``id``; its ``done`` (finish_reason ``abort``) still arrives."""
        self._send(self._core.encode(Cancel(id)), id)

    def stats(self) -> StatsReply:
        return self._final(self._submit(Stats(uuid.uuid4().hex)).id, StatsReply)

    def health(self) -> HealthReply:
        return self._final(self._submit(Health(uuid.uuid4().hex)).id, HealthReply)

    def close(self) -> None:
        if not self._core.is_closed:
            self._close_sockets()

    def reconnect(self) -> None:
        """Start over on a fresh socket (a new identity to the daemon): every request still pending
        raises :class:`ConnectionLost` when next waited on; the daemon aborts them when it notices."""
        if self._core.is_closed:
            raise ConnectionLost("closed", "the client is closed")
        self._core.reset()
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
        while self._monitor.poll(0):
            self._core.connection_event(self._event(self._monitor.recv_multipart()))

    def _submit(self, msg: Generate | Stats | Health):
        self._send_cancels()
        self._drain_monitor()  # events from before this request are not about it
        data = self._core.submit(msg)
        try:
            self._send(data, msg.id)
        except BaseException:
            self._core.discard(msg.id)
            raise
        return msg

    def _final(self, rid: str, kind: type):
        """Wait for ``rid``'s reply of type ``kind`` (raising an error reply)."""
        return self._core.final(rid, self._next(rid), kind)

    def _abandon(self, rid: str) -> None:
        """Drop ``rid``'s remaining replies and cancel it now (after a timeout or an early close)."""
        self._core.abandon(rid)
        self._send_cancels()

    def _send_cancels(self) -> None:
        while (rid := self._core.next_cancel()) is not None:
            self.cancel(rid)

    def _next(self, rid: str) -> Message:
        """The next message for ``rid``; messages for other ids are buffered."""
        self._send_cancels()
        deadline = time.monotonic() + self.timeout_s
        while (msg := self._core.next_reply(rid)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._abandon(rid)
                raise self._reply_timeout(rid)
            events = dict(self._poller.poll(remaining * 1e3))
            if self._monitor in events:
                self._drain_monitor()
            if self._sock in events:
                while self._sock.poll(0):
                    self._core.receive(self._sock.recv())
        return msg


class ChunkStream(StreamAssembly):
    """The chunks of one streaming request. After iteration, ``done`` is the ``done`` message and
    ``completion`` the assembled result. ``close()`` (or leaving a ``with`` block) before the end
    cancels the request."""

    def __init__(self, client: Client, rid: str) -> None:
        super().__init__(client._core, rid)
        self.client = client

    def __iter__(self) -> ChunkStream:
        return self

    def __next__(self) -> Chunk:
        if not self._is_open:
            raise StopIteration
        try:
            msg = self.client._next(self.id)
        except Exception:
            self._end()
            raise
        chunk = self._feed(msg)
        if chunk is None:
            raise StopIteration
        return chunk

    def close(self) -> None:
        if self._is_open:
            self._end()
            self.client._abandon(self.id)

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
