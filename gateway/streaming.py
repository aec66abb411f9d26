"""Noticing an HTTP client that goes away, so that its request is cancelled in the daemon at once.

:class:`EventStreamResponse` sends server-sent events while it listens for ``http.disconnect``; when the
client leaves (or the events end, or sending fails) it stops the generator and then awaits ``on_close``
(closing the daemon stream, which sends ``cancel``) outside of any cancelled task, so that the cancel
really goes out. :func:`until_disconnected` does the same for the awaits before a response starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
logger = logging.getLogger("specsched.gateway")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def wait_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client disconnected (the body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _settle(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled and
    :class:`ClientGone` raised."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await _settle(job, gone)
    if job.done() and not job.cancelled():
        return job.result()
    raise ClientGone()


class EventStreamResponse(Response):
    """``text/event-stream`` from an async iterator of SSE strings; ``on_close`` runs however it ends."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        self.events, self.on_close = events, on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({sender, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone.done() and not sender.done():
                logger.info("client disconnected mid-stream: cancelling its request")
        finally:
            await _settle(sender, gone)
            try:
                await self.events.aclose()  # type: ignore[attr-defined]
            finally:
                await self.on_close()
        if sender.done() and not sender.cancelled() and (exc := sender.exception()) is not None:
            if not isinstance(exc, OSError):  # OSError: the client is gone (ASGI 2.4)
                raise exc

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
