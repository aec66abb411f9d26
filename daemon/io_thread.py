"""The daemon's IO thread: the only user of the ROUTER socket once the server has started.

It receives frames, decodes and validates them (bad input is answered here and never reaches the
engine), rejects at once what its own counters can judge (admission.py: :func:`early_rejection`),
answers ``stats`` / ``health`` from the engine thread's latest snapshot, forwards ``generate`` /
``cancel`` to the engine thread through the inbox, and sends what the engine thread puts in the outbox
(lists of ``(client, message)``, one per step; it is woken through an inproc PAIR socket after every
step, so replies leave as soon as a step ends), detokenizing the chunks of requests without stop strings
on the way (request_stream.py: :class:`LateText`).

A client is considered gone when a send to its identity fails (``ROUTER_MANDATORY``: the peer's
connection is closed, or its send queue is full); its requests are then aborted (:class:`DropClient`).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import queue
import threading
import time
from typing import Protocol

import msgpack
import zmq

from specsched.daemon.admission import early_rejection, tokenize_prompt
from specsched.daemon.commands import Admit, CancelRequest, DropClient
from specsched.daemon.host_stats import host_stats
from specsched.daemon.limits import DaemonConfig
from specsched.daemon.log import LogWriter
from specsched.daemon.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Chunk,
    Done,
    Error,
    ErrorCode,
    Generate,
    Health,
    HealthReply,
    Message,
    ProtocolError,
    StartupStats,
    Stats,
    StatsReply,
    decode,
    encode,
)
from specsched.daemon.request_stream import LateText
from specsched.engine.stats import rss_bytes
from specsched.kernels.compile_watch import compile_watch

logger = logging.getLogger(__name__)
# the fields a chunk is packed with directly (encode's order); another set (a changed Chunk): encode
_IS_CHUNK_PACKED = tuple(f.name for f in dataclasses.fields(Chunk)) == (
    "id", "token_ids", "text", "proposed", "accepted"
)  # fmt: skip


def encode_reply(msg: Message) -> bytes:
    """``encode(msg)``; a chunk of plain values (str, int, a list of int) is packed directly into the
    same bytes: ~1 instead of ~6 us, one per streaming request per step, on the IO thread, which holds
    the interpreter lock while it encodes (the engine thread waits for it)."""
    if _IS_CHUNK_PACKED and type(msg) is Chunk:
        ids = msg.token_ids
        if (
            type(msg.id) is str
            and type(msg.text) is str
            and type(msg.proposed) is int
            and type(msg.accepted) is int
            and type(ids) is list
            and all(type(i) is int for i in ids)
        ):
            return msgpack.packb(
                {"v": PROTOCOL_VERSION, "type": "chunk", "id": msg.id, "token_ids": ids, "text": msg.text,
                 "proposed": msg.proposed, "accepted": msg.accepted},
                use_bin_type=True,
            )  # fmt: skip
    return encode(msg)


class ServerView(Protocol):
    """What the IO thread reads from the server that owns it (server.Server implements it): the
    config, replies and counters it completes, the shutdown flag, and the shutdown request."""

    cfg: DaemonConfig
    log: LogWriter | None
    stats_snapshot: StatsReply  # the engine thread's latest
    is_shutting_down: bool
    num_auth_denied: int
    uptime_s: float
    max_queue: int
    startup_stats: StartupStats | None  # the start-up's breakdown, once listening
    engine_tid: int | None  # the engine thread's kernel id, once it runs (daemon/host_stats.py)

    def health_reply(self, request_id: str | None) -> HealthReply: ...

    def request_shutdown(self, grace_s: float | None = None) -> None: ...


class IOThread:
    """``run()`` is the IO thread's body; it returns once the engine thread is done and every queued
    reply has been sent. ``server`` supplies the config, the stats snapshot and the shutdown flag."""

    def __init__(
        self,
        server: ServerView,
        router: zmq.Socket,
        wake_rx: zmq.Socket,
        inbox: queue.Queue,
        outbox: queue.Queue,
        engine_done: threading.Event,
        tokenizer=None,
    ) -> None:
        """``tokenizer``: the model's; when it may encode beside the engine thread
        (``Tokenizer.is_thread_safe``) this thread tokenizes each generate's prompt (:meth:`_tokenize`)."""
        self.server, self.cfg = server, server.cfg
        self._tokenizer = tokenizer if getattr(tokenizer, "is_thread_safe", False) else None
        self._router, self._wake_rx = router, wake_rx
        self._inbox, self._outbox, self._engine_done = inbox, outbox, engine_done
        self._inflight: dict[bytes, set[str]] = {}  # client -> its request ids the engine holds
        self._is_paced = getattr(self.cfg, "send_pace", "loop") == "step"
        self._num_inflight = 0
        self.num_bad_messages = 0
        self.num_rejected = 0

    def run(self) -> None:
        try:
            self._io_loop()
        except Exception:  # noqa: BLE001 -- without its IO thread the daemon cannot serve: stop it
            logger.exception("IO thread failed; shutting down")
            self.server.request_shutdown(0.0)
            self._engine_done.wait()
        finally:
            while True:  # generate requests the engine thread never took (it ended first)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, Admit):
                    msg = Error(cmd.msg.id, ErrorCode.SHUTTING_DOWN.value, "the daemon is shutting down")
                    self._send_safely(cmd.client, msg)

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while True:
            events = dict(poller.poll(100))
            is_woken = self._wake_rx in events
            if is_woken:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            # daemon.send_pace=step: replies go when the engine wakes this thread (at its device wait),
            # not whenever a request arrives; a poll that timed out sends what is there
            if is_woken or not self._is_paced or not events:
                self._drain_outbox()
            if self._router in events:
                for _ in range(256):  # then send again: replies are not starved by a flood
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._on_frames(frames)
                    except Exception as e:  # noqa: BLE001 -- a bug: answer it and keep serving
                        logger.exception("handling a message failed")
                        self._send_safely(frames[0], Error(None, ErrorCode.INTERNAL.value, repr(e)))
            if self._engine_done.is_set() and self._outbox.empty():
                break
        self._drain_outbox()

    def _drain_outbox(self) -> None:
        """Send what the engine and log-writer threads posted: lists of (client, message), in order."""
        while True:
            try:
                batch = self._outbox.get_nowait()
            except queue.Empty:
                return
            for client, msg in batch:
                if type(msg) is LateText:  # a chunk whose text is detokenized here (request_stream.py)
                    msg = self._resolve(msg)
                    if msg is None:
                        continue
                elif isinstance(msg, (Done, Error)):  # the request's last message
                    self._forget(client, msg.id)
                self._send(client, msg)

    def _resolve(self, late: LateText) -> Chunk | None:
        """``late``'s chunk with its text; None for a final flush that had nothing held back. A
        detokenizer that fails sends the ids without text (logged): the ``done`` still follows."""
        try:
            chunk = late.resolve()
        except Exception:  # noqa: BLE001 -- this thread must keep serving
            logger.exception("detokenizing a chunk of %r failed", late.chunk.id)
            chunk = late.chunk
        return chunk if chunk.token_ids or chunk.text else None

    def _forget(self, client: bytes, request_id: str | None) -> None:
        ids = self._inflight.get(client)
        if ids is not None and request_id in ids:
            ids.discard(request_id)
            self._num_inflight -= 1
            if not ids:
                del self._inflight[client]

    def _send(self, client: bytes, msg: Message) -> None:
        try:
            payload = encode_reply(msg)
        except Exception as e:  # noqa: BLE001 -- a bug; the client still gets an answer
            logger.exception("encoding a %s failed", msg.TYPE)
            payload = encode(
                Error(getattr(msg, "id", None), ErrorCode.INTERNAL.value, f"encoding failed: {e}")
            )
        try:
            self._router.send_multipart([client, payload], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno not in (errno.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self._client_gone(client, "disconnected" if e.errno == errno.EHOSTUNREACH else "not reading")

    def _send_safely(self, client: bytes, msg: Message) -> None:
        try:
            self._send(client, msg)
        except Exception:  # noqa: BLE001
            logger.exception("sending a %s failed", msg.TYPE)

    def _client_gone(self, client: bytes, why: str) -> None:
        ids = self._inflight.pop(client, None)
        if ids:
            self._num_inflight -= len(ids)
            logger.info("client %s %s: aborting its %d request(s)", client.hex(), why, len(ids))
            self._inbox.put(DropClient(client))

    def _on_frames(self, frames: list[bytes]) -> None:
        client = frames[0]
        try:
            if len(frames) != 2:
                raise ProtocolError(
                    ErrorCode.BAD_MESSAGE,
                    f"expected one frame per message (a DEALER socket), got {len(frames) - 1}",
                )
            msg = decode(frames[1])
        except ProtocolError as e:
            self.num_bad_messages += 1
            return self._error(client, e.request_id, e.code, e.message)
        if isinstance(msg, Generate):
            self._on_generate(client, msg)
        elif isinstance(msg, Cancel):
            if msg.id in self._inflight.get(client, ()):
                self._inbox.put(CancelRequest(client, msg.id))
            else:
                self._error(
                    client, msg.id, ErrorCode.UNKNOWN_ID, f"cancel.id: {msg.id!r} is not in flight here"
                )
        elif isinstance(msg, Stats):
            self._send(client, self._stats_reply(msg.id))
        elif isinstance(msg, Health):
            self._send(client, self.server.health_reply(msg.id))

    def _error(self, client: bytes, request_id: str | None, code: ErrorCode, message: str) -> None:
        self._send(client, Error(request_id, code.value, message))

    def _on_generate(self, client: bytes, msg: Generate) -> None:
        ids = self._inflight.get(client, set())
        num_queued = self._num_inflight - self.server.stats_snapshot.num_running
        rejection = early_rejection(
            msg,
            ids,
            self._num_inflight,
            num_queued,
            self.server.max_queue,
            self.cfg,
            self.server.is_shutting_down,
        )
        if rejection is not None:
            self.num_rejected += 1
            return self._error(client, msg.id, *rejection)
        arrival = time.time()
        try:
            ids = self._tokenize(msg)
        except ProtocolError as e:
            self.num_rejected += 1
            return self._error(client, msg.id, e.code, e.message)
        self._inflight.setdefault(client, set()).add(msg.id)
        self._num_inflight += 1
        self._inbox.put(Admit(client, msg, arrival, prompt_ids=ids))

    def _tokenize(self, msg: Generate) -> list[int] | None:
        """The prompt's ids, tokenized here (the Rust encode runs without the interpreter lock, beside
        the engine thread's steps), or None: the engine thread tokenizes (no tokenizer that may run here,
        ids sent, or an unexpected failure, which the engine thread's admission then reports)."""
        if self._tokenizer is None or msg.prompt_ids is not None:
            return None
        try:
            return tokenize_prompt(msg, self._tokenizer)
        except ProtocolError:
            raise
        except Exception:  # noqa: BLE001 -- this thread must keep serving: the engine thread answers
            logger.exception("tokenizing %r on the IO thread failed; the engine thread tries", msg.id)
            return None

    def _stats_reply(self, request_id: str | None) -> StatsReply:
        """The engine thread's latest snapshot, completed with what the IO thread and the server count."""
        server, snap, log = self.server, self.server.stats_snapshot, self.server.log
        watch = compile_watch()
        return dataclasses.replace(
            snap,
            id=request_id,
            uptime_s=server.uptime_s,
            num_requests_rejected=snap.num_requests_rejected + self.num_rejected,
            num_bad_messages=self.num_bad_messages,
            num_log_failures=log.num_failures if log is not None else 0,
            num_log_dropped=log.num_dropped if log is not None else 0,
            num_auth_denied=server.num_auth_denied,
            num_clients=len(self._inflight),
            rss_bytes=rss_bytes(),
            num_kernels_built_at_start=watch.num_built - watch.num_after_ready,
            num_compiles_after_start=watch.num_after_ready,
            startup=server.startup_stats,
            host=host_stats(
                server.engine_tid, threading.get_native_id(), log.native_id if log is not None else None
            ),
        )
