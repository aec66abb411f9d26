"""Noticing an HTTP client that goes away, so that its request is cancelled in the daemon at once.

:class:`DisconnectWatch` listens for ``http.disconnect`` for the whole life of a request, and
:meth:`DisconnectWatch.race` awaits one step of work (the daemon's next chunk) unless the client leaves
first. The decision is taken after every step from the watch itself, not from whether a cancelled task
stopped: a cancellation can be swallowed (``asyncio.wait_for`` before Python 3.12 may return a result
that arrived together with the cancel), so "the client is gone" never depends on it.
:class:`EventStreamResponse` sends server-sent events that way and, however it ends, closes the events
and awaits ``on_close`` (closing the daemon stream, which sends ``cancel``).
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
    """The HTTP client disconnected before its answer was complete."""


async def wait_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client disconnected (the body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectWatch:
    """One task waiting for the client's ``http.disconnect``; :meth:`close` it at the end."""

    def __init__(self, receive: Receive) -> None:
        self._gone = asyncio.ensure_future(wait_disconnect(receive))

    @property
    def is_gone(self) -> bool:
        return self._gone.done() and not self._gone.cancelled()

    async def race(self, work: Awaitable[T]) -> T:
        """``await work``; raises :class:`ClientGone` (``work`` cancelled) if the client left meanwhile."""
        if self.is_gone:
            raise ClientGone()
        job = asyncio.ensure_future(work)
        await asyncio.wait({job, self._gone}, return_when=asyncio.FIRST_COMPLETED)
        if not job.done():
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
        if self.is_gone:
            raise ClientGone()
        return job.result()

    async def close(self) -> None:
        self._gone.cancel()
        await asyncio.gather(self._gone, return_exceptions=True)


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
        watch = DisconnectWatch(receive)
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            while (event := await watch.race(anext(self.events, None))) is not None:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientGone:
            logger.info("client disconnected mid-stream: cancelling its request")
        except OSError:  # ASGI 2.4 servers raise it on a send to a client that is gone
            logger.info("client gone mid-stream (send failed): cancelling its request")
        finally:
            await watch.close()
            try:
                await self.events.aclose()  # type: ignore[attr-defined]
            finally:
                await self.on_close()
