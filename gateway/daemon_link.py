"""The gateway's side of the daemon: one :class:`~specsched.client.AsyncClient` (one DEALER socket, which
ZeroMQ reconnects by itself when the daemon comes back), a short ``health`` probe that tells a daemon
that is down (503) from one that is up, and the model name served."""

from __future__ import annotations

import asyncio

from specsched.client import AsyncClient, SpecschedError
from specsched.daemon.protocol import HealthReply
from specsched.gateway.config import GatewayConfig
from specsched.gateway.errors import daemon_down, from_client_error


class DaemonLink:
    """Owns the client when it made it (:meth:`open` inside the server's event loop, :meth:`close`)."""

    def __init__(self, cfg: GatewayConfig, client: AsyncClient | None = None) -> None:
        self.cfg = cfg
        self._client = client
        self._owns_client = client is None

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            raise RuntimeError("DaemonLink.open() was not called (the app's lifespan opens it)")
        return self._client

    async def open(self) -> None:
        if self._client is None:
            self._client = AsyncClient(
                self.cfg.daemon_endpoint,
                timeout_s=self.cfg.reply_timeout_s,
                max_message_bytes=self.cfg.max_message_bytes,
            )

    async def close(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.close()
            self._client = None

    async def health(self) -> HealthReply:
        """The daemon's ``health_reply``; raises a 503 :class:`APIError` when it does not answer within
        ``health_timeout_s``, the connection dropped, or it is shutting down."""
        t = self.cfg.health_timeout_s
        try:
            reply = await asyncio.wait_for(self.client.health(), t)
        except asyncio.TimeoutError:
            raise daemon_down(
                f"no reply to health within {t} s (is specsched-serve running at {self.cfg.daemon_endpoint}?)"
            ) from None
        except SpecschedError as e:
            raise from_client_error(e) from e
        if reply.status != "ok":
            raise daemon_down(f"it is {reply.status}")
        return reply

    async def model_name(self) -> str:
        """The model name served: the config's, else the daemon's (asked each time: it may restart)."""
        reply = await self.health()
        return self.cfg.model or reply.model
