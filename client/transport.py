"""The transport both clients share: one DEALER socket to the daemon, with a monitor socket that
reports dropped connections and failed CURVE handshakes, around one sans-IO :class:`ClientCore`."""

from __future__ import annotations

import struct

import zmq

from specsched.client.core import ClientCore
from specsched.client.errors import MONITORED_EVENTS, RequestTimeout
from specsched.daemon.curve_keys import CurveKeys

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"


class ClientSocket:
    """Opens (``_open_socket``) and closes the socket; the subclasses send, receive and wait."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float,
        max_message_bytes: int,
        ctx: zmq.Context | None,
        curve: CurveKeys | None,
    ) -> None:
        """``ctx``: a ZeroMQ context to open the socket in, shared with other clients of the process
        (one IO thread for all: at 8 clients a load process of ``bench=serve``, ~15 % less CPU per
        streamed chunk than a context each) and left open at close; None: a context of its own."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if curve is not None and not isinstance(curve, CurveKeys):
            raise TypeError(f"curve must be a CurveKeys, got {type(curve).__name__}")
        self.endpoint, self.timeout_s, self.max_message_bytes = endpoint, timeout_s, max_message_bytes
        self.curve = curve
        if ctx is not None and (not isinstance(ctx, zmq.Context) or "asyncio" in type(ctx).__module__):
            kind = f"{type(ctx).__module__}.{type(ctx).__name__}"
            raise TypeError(f"context must be a plain zmq.Context, got {kind}")
        self._core = ClientCore(max_message_bytes)
        self._ctx, self._owns_ctx = (zmq.Context(), True) if ctx is None else (ctx, False)
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
        self._monitor = self._sock.get_monitor_socket(MONITORED_EVENTS)
        self._sock.connect(self.endpoint)

    def _close_socket(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        if self._sock is not None:
            self._sock.close(linger=0)

    def _close_sockets(self) -> None:
        self._core.close()
        self._close_socket()
        if self._owns_ctx:
            self._ctx.term()

    @staticmethod
    def _event(frames: list[bytes]) -> int:
        """The event number of a monitor message."""
        return struct.unpack("=H", frames[0][:2])[0]

    def _send_timeout(self, rid: str | None) -> RequestTimeout:
        return RequestTimeout("timeout", f"could not queue a message within {self.timeout_s} s", rid)

    def _reply_timeout(self, rid: str) -> RequestTimeout:
        return RequestTimeout("timeout", f"no reply for {rid!r} within {self.timeout_s} s", rid)
