"""The asyncio client: a thin shell around the sans-IO :class:`ClientCore` on a plain ZeroMQ socket that
the event loop watches (``loop.add_reader`` on the socket's and its monitor's file descriptors).

ZeroMQ signals a socket's descriptor on an edge (something may have changed), so a callback reads
until the socket holds nothing (``zmq.Again``), and every send is followed by such a read: a send may
take the signal of replies that arrived meanwhile. Each frame is routed by the core, and the task
waiting for that request (one future and one timer) is woken. On the load generator's processes of
``bench=serve`` this costs about a third of what zmq.asyncio's futures did per streamed chunk
(bench/client_load.py). ``AsyncClient`` and ``AsyncChunkStream`` are re-exported by
``specsched.client.sync_client`` (whose docstring describes the client library).
"""

from __future__ import annotations

import asyncio
import uuid

import zmq

from specsched.client.core import Completion, StreamAssembly, build_generate, completion_of
from specsched.client.errors import ConnectionLost
from specsched.client.transport import DEFAULT_ENDPOINT, ClientSocket
from specsched.daemon.curve_keys import CurveKeys
from specsched.daemon.protocol import (
    Cancel,
    Chunk,
    Done,
    Generate,
    Health,
    HealthReply,
    Message,
    SpecOptions,
    Stats,
    StatsReply,
)


def _settle(ready: asyncio.Future, is_woken: bool) -> None:
    """End a reply wait: woken (a reply or a connection event came) or timed out."""
    if not ready.done():
        ready.set_result(is_woken)


def _recv_now(sock: zmq.Socket, multipart: bool = False):
    """The next message ``sock`` holds (a frame, or the frames with ``multipart``), None when empty."""
    try:
        return sock.recv_multipart(zmq.NOBLOCK) if multipart else sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None


class AsyncClient(ClientSocket):
    """asyncio client: any number of concurrent requests on one socket; the event loop's reader
    callback routes replies to the tasks waiting for them. Create and use it inside one event loop
    (a selector loop: ``add_reader``, the default on Linux and macOS)."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout_s: float = 60.0,
        max_message_bytes: int = 1 << 20,
        curve: CurveKeys | None = None,
        context: zmq.Context | None = None,
    ):
        super().__init__(endpoint, timeout_s, max_message_bytes, context, curve)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop watching the sockets, once reading
        self._waiting: dict[str, asyncio.Future] = {}  # request id -> settled when its next reply is there

    async def generate(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                       messages: list[dict] | None = None, max_tokens: int = 64, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                       stop: list[str] | None = None, spec: SpecOptions | dict | None = None,
                       id: str | None = None, timeout: float | None = None) -> Completion:  # fmt: skip
        msg = build_generate(False, prompt, prompt_ids, messages, max_tokens, temperature, top_p, top_k,
                             seed, stop, spec, id, timeout)  # fmt: skip
        await self._submit(msg)
        try:
            return completion_of(await self._final(msg.id, Done))
        finally:
            self._core.abandon(msg.id)  # left before its last reply (task cancelled): cancel it later

    def stream(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
               messages: list[dict] | None = None, max_tokens: int = 64, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
               spec: SpecOptions | dict | None = None, id: str | None = None,
               timeout: float | None = None) -> AsyncChunkStream:  # fmt: skip
        """``async for chunk in client.stream(...)``; the request is sent at the first iteration."""
        msg = build_generate(True, prompt, prompt_ids, messages, max_tokens, temperature, top_p, top_k,
                             seed, stop, spec, id, timeout)  # fmt: skip
        return AsyncChunkStream(self, msg)

    async def cancel(self, id: str) -> None:
        await self._send(self._core.encode(Cancel(id)), id)

    async def stats(self) -> StatsReply:
        return await self._ask(Stats(uuid.uuid4().hex), StatsReply)

    async def health(self) -> HealthReply:
        return await self._ask(Health(uuid.uuid4().hex), HealthReply)

    async def close(self) -> None:
        if self._core.is_closed:
            return
        self._stop_reading()
        self._close_sockets()
        self._wake_all()  # waiting requests raise ConnectionLost

    async def reconnect(self) -> None:
        """Start over on a fresh socket (a new identity): requests pending raise :class:`ConnectionLost`."""
        if self._core.is_closed:
            raise ConnectionLost("closed", "the client is closed")
        self._stop_reading()
        self._core.reset()
        self._wake_all()
        self._close_socket()
        self._open_socket()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- internals --------------------------------------------------------------------------------
    async def _submit(self, msg: Generate | Stats | Health) -> None:
        await self._send_cancels()
        if self._loop is None and not self._core.is_closed:
            while (frames := _recv_now(self._monitor, multipart=True)) is not None:
                self._core.connection_event(self._event(frames))  # from before: no new request's concern
            self._start_reading()
        data = self._core.submit(msg)
        try:
            await self._send(data, msg.id)
        except BaseException:
            self._core.discard(msg.id)
            raise

    async def _ask(self, msg: Stats | Health, kind: type):
        try:
            await self._submit(msg)
            return await self._final(msg.id, kind)
        finally:
            self._core.discard(msg.id)

    async def _send(self, data: bytes, rid: str | None) -> None:
        """Queue ``data`` to the daemon; while the queue is full (no connection yet, or the daemon not
        reading) retry with a growing pause (1 ms to 50 ms), for at most ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + self.timeout_s, 0.001
        while True:
            try:
                self._sock.send(data, zmq.NOBLOCK)
                break
            except zmq.Again:
                if loop.time() >= deadline:
                    raise self._send_timeout(rid) from None
                await asyncio.sleep(pause)
                pause = min(2 * pause, 0.05)
        if self._loop is not None:
            loop.call_soon(self._on_replies)  # the send may have taken the signal of replies there

    async def _send_cancels(self) -> None:
        while (rid := self._core.next_cancel()) is not None:
            await self.cancel(rid)

    async def _next(self, rid: str) -> Message:
        """The next reply for ``rid``, waiting at most ``timeout_s`` (then it is cancelled). The wait is
        one future and one timer (not ``asyncio.wait_for``, which costs a task a call): a streamed
        request waits once per chunk."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while (msg := self._core.next_reply(rid)) is None:
            ready = self._waiting[rid] = loop.create_future()
            timer = loop.call_at(deadline, _settle, ready, False)
            try:
                is_woken = await ready
            finally:
                timer.cancel()
                self._waiting.pop(rid, None)
            if not is_woken and (msg := self._core.next_reply(rid)) is None:
                self._core.abandon(rid)
                await self._send_cancels()
                raise self._reply_timeout(rid)
        return msg

    async def _final(self, rid: str, kind: type):
        return self._core.final(rid, await self._next(rid), kind)

    def _wake_all(self) -> None:
        for ready in self._waiting.values():
            _settle(ready, True)

    def _start_reading(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            loop.add_reader(self._sock.FD, self._on_replies)
        except NotImplementedError:
            raise RuntimeError(
                f"AsyncClient needs an event loop that watches file descriptors (add_reader), and "
                f"{type(loop).__name__} does not; on Windows, use "
                f"asyncio.set_event_loop_policy(asyncio.WindowsSelectorEventLoopPolicy())"
            ) from None
        loop.add_reader(self._monitor.FD, self._on_events)
        self._loop = loop

    def _stop_reading(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._sock.FD)
            self._loop.remove_reader(self._monitor.FD)
            self._loop = None

    def _on_replies(self) -> None:
        """Route every reply the socket holds and wake the requests they are for."""
        if self._loop is None:  # a read scheduled by a send, after the client stopped reading
            return
        while (frame := _recv_now(self._sock)) is not None:
            ready = self._waiting.get(self._core.receive(frame))
            if ready is not None:
                _settle(ready, True)

    def _on_events(self) -> None:
        """Feed the monitor's connection events to the core; the requests they concern wake up."""
        is_any = False
        while (frames := _recv_now(self._monitor, multipart=True)) is not None:
            self._core.connection_event(self._event(frames))
            is_any = True
        if is_any:
            self._wake_all()


class AsyncChunkStream(StreamAssembly):
    """Async iterator over one streaming request's chunks; ``done`` / ``completion`` after the end;
    ``await aclose()`` (or ``async with``) before the end cancels the request."""

    def __init__(self, client: AsyncClient, msg: Generate) -> None:
        super().__init__(client._core, msg.id)
        self.client, self.msg = client, msg
        self._is_sent = False

    def __aiter__(self) -> AsyncChunkStream:
        return self

    async def __anext__(self) -> Chunk:
        if not self._is_open:
            raise StopAsyncIteration
        if not self._is_sent:
            await self.client._submit(self.msg)
            self._is_sent = True
        try:
            msg = await self.client._next(self.id)
        except Exception:
            self._end()
            raise
        chunk = self._feed(msg)
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        if self._is_open:
            self._end()
            if self.client._core.abandon(self.id):
                await self.client._send_cancels()

    async def __aenter__(self) -> AsyncChunkStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
