"""Final replies held until their request's row is in the decision log (``log.durable``): the engine
thread hands a request's last message (``done``, or the ``error`` of a failed step) to
:class:`HeldReplies` after the list with its chunks; the log's writer thread releases it once the row is
committed, so a client never hears of a request the log could lose (daemon/serving.py)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from specsched.daemon.messages import Message

Outgoing = tuple[bytes, Message]  # (client identity, message): the outbox carries lists of these


class HeldReplies:
    """Final replies waiting for their request's log row: ``send_after([(seq, client, msg), ...])`` holds
    each reply until the log has settled record ``seq`` (committed it, or counted its failed write:
    durability then does not hold, but the client is answered), then the writer thread posts them to the
    outbox as one list (``post``) and wakes the IO thread (``wake``). Both callables must be thread-safe."""

    def __init__(self, log, post: Callable[[list[Outgoing]], None], wake: Callable[[], None]) -> None:
        self.log, self.post, self.wake = log, post, wake
        self._held: deque[tuple[int, bytes, Message]] = deque()  # ascending seq (one producer thread)
        self._lock = threading.Lock()
        log.on_settled(self.release)

    def __len__(self) -> int:
        return len(self._held)

    def send_after(self, replies: list[tuple[int, bytes, Message]]) -> None:
        """``replies`` in ascending seq; those already settled are posted at once (the caller wakes)."""
        with self._lock:  # the check and the append are one step: a release cannot slip in between
            settled = self.log.settled_seq
            ready = [(client, msg) for seq, client, msg in replies if seq <= settled]
            self._held.extend(r for r in replies if r[0] > settled)
            if ready:
                self.post(ready)

    def release(self, settled_seq: float) -> None:
        """Send every held reply whose record is settled, in order (the writer thread calls this)."""
        with self._lock:
            ready = []
            while self._held and self._held[0][0] <= settled_seq:
                _, client, msg = self._held.popleft()
                ready.append((client, msg))
            if ready:
                self.post(ready)
        if ready:
            self.wake()

    def release_all(self) -> None:
        self.release(float("inf"))
