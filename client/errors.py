"""The client library's typed errors (re-exported by ``specsched.client.sync_client``).

:class:`ServerError` subclasses carry the daemon's error ``code``; :class:`RequestTimeout` (a
``TimeoutError``) means no reply came within the client's ``timeout_s``; :class:`ConnectionLost` (a
``ConnectionError``) that the connection dropped, or the client was closed or reconnected, while the
request was in flight; :class:`MessageTooLarge` that nothing was sent.
"""

from __future__ import annotations

import functools
import operator

import zmq

from specsched.daemon.messages import Error, ErrorCode


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


class MessageTooLarge(SpecschedError, ValueError):
    """The encoded message exceeds ``max_message_bytes`` (the daemon's ZeroMQ would drop it and close
    the connection); nothing was sent."""


def server_error(err: Error) -> ServerError:
    return SERVER_ERRORS.get(err.code, ServerError)(err.code, err.message, err.id)


# ---- connection events (the socket monitor's) ------------------------------------------------------

HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the daemon refused this client's CURVE key (not allowed) "
    "or the server key is wrong",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed: the daemon requires CURVE "
    "(pass curve=CurveKeys(...)), or this client uses CURVE and the daemon does not",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed (a CURVE mismatch, or not a specsched daemon)",
}
MONITORED_EVENTS = (
    zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | functools.reduce(operator.or_, HANDSHAKE_FAILED)
)


def connection_error(event: int, rid: str | None) -> ConnectionLost:
    """The error for requests pending when the monitor reported ``event``."""
    if event in HANDSHAKE_FAILED:
        return AuthenticationFailed("auth_failed", HANDSHAKE_FAILED[event], rid)
    return ConnectionLost("connection_lost", "the connection to the daemon dropped", rid)
