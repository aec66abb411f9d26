"""The asyncio client (zmq.asyncio): a thin shell around the sans-IO :class:`ClientCore`.

One reader task feeds every reply frame and monitor event to the core and wakes the task waiting for
that request; ``AsyncClient`` and ``AsyncChunkStream`` are re-exported by ``specsched.client.sync_client``
(whose docstring describes the client library).
"""

from __future__ import annotations

import asyncio
import uuid

import zmq
import zmq.asyncio

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


class AsyncClient(ClientSocket):
    """asyncio client (zmq.asyncio): any number of concurrent requests on one socket; one reader
    task routes replies to the tasks waiting for them. Create and use it inside one event loop."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout_s: float = 60.0,
        max_message_bytes: int = 1 << 20,
        curve: CurveKeys | None = None,
    ):
        super().__init__(endpoint, timeout_s, max_message_bytes, zmq.asyncio.Context(), curve)
        self._reader: asyncio.Task | None = None
        self._waiting: dict[str, asyncio.Event] = {}  # request id -> set when its next reply is there

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
        await self._stop_reader()
        self._close_sockets()
        self._wake_all()  # waiting requests raise ConnectionLost

    async def reconnect(self) -> None:
        """Start over on a fresh socket (a new identity): requests pending raise :class:`ConnectionLost`."""
        if self._core.is_closed:
            raise ConnectionLost("closed", "the client is closed")
        await self._stop_reader()
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
        if self._reader is None and not self._core.is_closed:
            while await self._monitor.poll(0):  # events from before the reader ran concern no new request
                self._core.connection_event(self._event(await self._monitor.recv_multipart()))
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
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
        try:
            await asyncio.wait_for(self._sock.send(data), self.timeout_s)
        except (asyncio.TimeoutError, zmq.Again):  # the queue to the daemon stayed full
            raise self._send_timeout(rid) from None

    async def _send_cancels(self) -> None:
        while (rid := self._core.next_cancel()) is not None:
            await self.cancel(rid)

    async def _next(self, rid: str) -> Message:
        """The next reply for ``rid``, waiting at most ``timeout_s`` (then it is cancelled)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while (msg := self._core.next_reply(rid)) is None:
            ready = self._waiting[rid] = asyncio.Event()
            try:
                await asyncio.wait_for(ready.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                self._core.abandon(rid)
                await self._send_cancels()
                raise self._reply_timeout(rid) from None
            finally:
                self._waiting.pop(rid, None)
        return msg

    async def _final(self, rid: str, kind: type):
        return self._core.final(rid, await self._next(rid), kind)

    def _wake_all(self) -> None:
        for ready in self._waiting.values():
            ready.set()

    async def _read_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            events = dict(await poller.poll())
            if self._monitor in events:
                self._core.connection_event(self._event(await self._monitor.recv_multipart()))
                self._wake_all()
            if self._sock in events:
                while await self._sock.poll(0):
                    ready = self._waiting.get(self._core.receive(await self._sock.recv()))
                    if ready is not None:
                        ready.set()

    async def _stop_reader(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
            self._reader = None


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
