"""The client's sans-IO core: all that :class:`Client` and :class:`AsyncClient` share but the socket.

:class:`ClientCore` builds and encodes requests (refusing what the daemon would drop without a reply),
decodes reply frames and routes them to their requests by id, keeps which requests are pending, lost
(the connection dropped) or abandoned (timed out, left early: their late replies are dropped and they
are cancelled on the daemon), and maps replies and connection events onto typed results and errors.
:class:`StreamAssembly` turns one streaming request's replies into chunks and its completion. Neither
touches a socket or a clock: a client feeds in frames (:meth:`ClientCore.receive`) and monitor events
(:meth:`ClientCore.connection_event`), sends what :meth:`ClientCore.submit` and
:meth:`ClientCore.next_cancel` give it, and asks :meth:`ClientCore.next_reply` for a request's reply.
"""

from __future__ import annotations

import logging
import uuid
import weakref
from collections import deque
from dataclasses import dataclass, field

import zmq

from specsched.client.errors import (
    HANDSHAKE_FAILED,
    ConnectionLost,
    DuplicateId,
    MessageTooLarge,
    SpecschedError,
    connection_error,
    server_error,
)
from specsched.daemon.protocol import (
    MAX_ID_CHARS,
    SERVER_TYPES,
    ChatMessage,
    Chunk,
    Done,
    Error,
    ErrorCode,
    Generate,
    Message,
    ProtocolError,
    SpecOptions,
    SpecUsage,
    Usage,
    decode,
    encode,
)

logger = logging.getLogger("specsched.client.sync_client")  # the client library's one logger name


@dataclass
class Completion:
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort | timeout | error
    usage: Usage = field(default_factory=Usage)
    spec: SpecUsage = field(default_factory=SpecUsage)


def completion_of(msg: Done, text: str | None = None, token_ids: list[int] | None = None) -> Completion:
    """The result of a request from its ``done`` (and, for a stream, the text and ids of its chunks)."""
    text = msg.text if text is None else text
    token_ids = msg.token_ids if token_ids is None else token_ids
    return Completion(msg.id, text or "", list(token_ids or []), msg.finish_reason, msg.usage, msg.spec)


def build_generate(stream: bool, prompt, prompt_ids, messages, max_tokens, temperature, top_p, top_k, seed,
                   stop, spec, id, timeout=None) -> Generate:  # fmt: skip
    """The ``generate`` message of a ``generate(...)`` / ``stream(...)`` call (a uuid4 id unless given)."""
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


class ClientCore:
    """The state of one client's requests on one connection."""

    def __init__(self, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self.is_closed = False
        self._replies: dict[str, deque[Message]] = {}  # pending ids -> replies received, not yet taken
        self._lost: dict[str, int] = {}  # pending ids whose connection dropped -> the monitor event
        self._abandoned: set[str] = set()  # ids whose remaining replies are dropped
        self._to_cancel: list[str] = []  # abandoned ids to cancel on the daemon at the next call
        # the last handshake failed (monitor event) and none succeeded since: new requests fail at once
        self._refused_by: int | None = None

    # ---- requests ---------------------------------------------------------------------------------
    def encode(self, msg: Message) -> bytes:
        """``msg`` as bytes; raises :class:`ConnectionLost` when closed, :class:`MessageTooLarge` when
        the daemon's ZeroMQ would drop it (and disconnect us)."""
        rid = getattr(msg, "id", None)
        if self.is_closed:
            raise ConnectionLost("closed", "the client is closed", rid)
        data = encode(msg)
        if len(data) > self.max_message_bytes:
            raise MessageTooLarge(
                "message_too_large", f"{len(data)} bytes > max_message_bytes {self.max_message_bytes}", rid
            )
        return data

    def submit(self, msg: Generate | Message) -> bytes:
        """The bytes to send for a request; from now on its replies are kept (``discard`` it when the
        send fails). Raises :class:`DuplicateId` when a request with its id is still pending."""
        if msg.id in self._replies:
            raise DuplicateId(ErrorCode.DUPLICATE_ID.value, f"id {msg.id!r} is already in flight", msg.id)
        if self._refused_by is not None:  # the failure came before this request: it would never be read
            raise connection_error(self._refused_by, msg.id)
        data = self.encode(msg)
        self._replies[msg.id] = deque()
        self._lost.pop(msg.id, None)
        return data

    def is_pending(self, rid: str) -> bool:
        return rid in self._replies

    def discard(self, rid: str) -> None:
        """``rid`` is no longer pending (it ended, or nobody waits for it); later replies are dropped."""
        self._replies.pop(rid, None)
        self._lost.pop(rid, None)

    def abandon(self, rid: str) -> bool:
        """Drop ``rid``'s remaining replies and queue a ``cancel`` for it (after a timeout or when its
        caller left early). False when it was not pending."""
        if self._replies.pop(rid, None) is None:
            return False
        self._lost.pop(rid, None)
        self._abandoned.add(rid)
        self._to_cancel.append(rid)
        return True

    def next_cancel(self) -> str | None:
        """An abandoned id to send a ``cancel`` for now (None when there is none, or the client is closed)."""
        return self._to_cancel.pop() if self._to_cancel and not self.is_closed else None

    # ---- replies ----------------------------------------------------------------------------------
    def receive(self, frame: bytes) -> str | None:
        """Route one reply frame; returns the id of the pending request it is for (else None: dropped)."""
        try:
            msg = decode(frame, allowed=SERVER_TYPES)
        except ProtocolError as e:
            logger.warning("dropping an unreadable reply from the daemon: %s", e)
            return None
        rid = msg.id
        if rid is None:
            if isinstance(msg, Error):
                logger.warning("daemon error without a request id: %s: %s", msg.code, msg.message)
            else:
                logger.warning("dropping a %s reply without a request id", msg.TYPE)
            return None
        if rid in self._abandoned:
            if isinstance(msg, (Done, Error)):  # its last reply: the id may be used again
                self._abandoned.discard(rid)
            return None
        replies = self._replies.get(rid)
        if replies is None:  # not ours (any more), e.g. an unknown_id reply to a cancel
            return None
        replies.append(msg)
        return rid

    def connection_event(self, event: int) -> None:
        """The socket monitor reported ``event``: it concerns the requests pending now (the first event
        names the cause). Their replies already received still come first. A failed handshake also
        refuses the requests submitted after it, until a handshake succeeds (ZeroMQ keeps retrying)."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._refused_by = None
            return
        if event in HANDSHAKE_FAILED:
            self._refused_by = event
        for rid in self._replies:
            self._lost.setdefault(rid, event)

    def next_reply(self, rid: str) -> Message | None:
        """``rid``'s next reply, or None while there is none yet. Raises :class:`ConnectionLost`
        (:class:`AuthenticationFailed`) when its connection dropped or the client was closed."""
        replies = self._replies.get(rid)
        if replies:
            return replies.popleft()
        if rid in self._lost:
            self._replies.pop(rid, None)
            raise connection_error(self._lost.pop(rid), rid)
        if self.is_closed:
            raise ConnectionLost("closed", "the client is closed", rid)
        return None

    def final(self, rid: str, reply: Message, kind: type):
        """``reply`` as the last reply of ``rid``: returned when it is a ``kind``, raised as a typed
        error otherwise. ``rid`` is no longer pending."""
        self.discard(rid)
        if isinstance(reply, kind):
            return reply
        if isinstance(reply, Error):
            raise server_error(reply)
        raise SpecschedError("bad_reply", f"expected {kind.TYPE} for {rid!r}, got {reply.TYPE}", rid)

    # ---- the connection ---------------------------------------------------------------------------
    def close(self) -> None:
        """The client is closed: pending requests raise :class:`ConnectionLost` once their replies
        received so far are taken."""
        self.is_closed = True

    def reset(self) -> None:
        """A fresh socket (a new identity): every pending request is lost at once (replies not yet
        taken are dropped); nothing is left to cancel or to drop."""
        for rid, replies in self._replies.items():
            replies.clear()
            self._lost.setdefault(rid, zmq.EVENT_DISCONNECTED)
        self._abandoned.clear()
        self._to_cancel.clear()


class StreamAssembly:
    """One streaming request's replies in (:meth:`_feed`), chunks out; ``done`` is the ``done`` message
    after the end and ``completion`` the assembled result. Garbage-collected unfinished (e.g. after
    ``break``), it is abandoned: cancelled at the client's next call rather than buffered."""

    def __init__(self, core: ClientCore, rid: str) -> None:
        self.id = rid
        self.done: Done | None = None
        self._core = core
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._is_open = True
        self._finalizer = weakref.finalize(self, core.abandon, rid)

    @property
    def completion(self) -> Completion | None:
        return None if self.done is None else completion_of(self.done, "".join(self._text), self._token_ids)

    def _feed(self, msg: Message) -> Chunk | None:
        """The chunk to yield, or None at the end (``done``); raises the typed error of an ``error``."""
        if isinstance(msg, Chunk):
            self._text.append(msg.text)
            self._token_ids.extend(msg.token_ids)
            return msg
        self._end()
        self._core.discard(self.id)
        if isinstance(msg, Done):
            self.done = msg
            return None
        if isinstance(msg, Error):
            raise server_error(msg)
        raise SpecschedError("bad_reply", f"unexpected {msg.TYPE} in the stream of {self.id!r}", self.id)

    def _end(self) -> None:
        self._is_open = False
        self._finalizer.detach()
