"""Who joins a replayed batch, and when (:func:`specsched.policies.replay.simulate`).

Open loop, every recorded request is queued at once and joins in its recorded order as slots free.
Closed loop (``bench=serve``'s clients), each client has one request running at a time, its next one
joining when the last finished, and optionally:

- **busy periods** (``segments``: per request, the live busy period it came in, non-decreasing): a
  request joins only once every request of earlier periods has finished (the live batch drained
  there: e.g. ``bench=serve``'s rounds, each ending with its last request);
- **round trips** (``think_ms``: per request, the ms from its client's last request's finish to its
  arrival, live): it joins that long after its client's last request finished in the replay's clock
  (a batch with nobody ready waits, time that counts on neither side, as the idle time live);
- **windows** (``window_ms``: per busy period, the ms of the live steps while its clients were
  sending, its first arrival to its last): the clients send for as long in the replay's clock,
  prefills included (each request ``prefill_ms`` of it), its idle waits left out (the live window
  sums the steps' ms: a round trip with nobody running is in neither), going round their recorded
  requests of the period again once those are done; then no client sends again in that period (a
  client's first request of the period goes whenever it is ready: the live window held it) and the
  batch drains. A
  policy faster or slower than the recorded one gets through other numbers of each client's
  requests in a window: replaying the recorded requests alone, once each, ran the client with the
  most of them on alone at the end (H200, 2026-12-06, goodput's N = 4 passes: one client, whose
  answers end early, sent 113 requests and the others 13-20; replayed at k = 0 the 113 ran alone at
  batch 1 for half the replay, and non-speculative was predicted 46 % below its live rate).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from specsched.policies.replay_log import RecordedRequest


class Arrivals:
    """The replay's request source and clock (predicted ms of the steps so far, the prefills of
    windowed requests and the idle waits of round trips added). The caller adds each step's ms to
    ``clock``, calls :meth:`admit` before each step, :meth:`finish` for each request that finished,
    and :meth:`wait` when nothing runs."""

    def __init__(
        self,
        requests: Sequence[RecordedRequest],
        closed_loop: bool = False,
        segments: Sequence[int] | None = None,
        think_ms: Sequence[float] | None = None,
        window_ms: Sequence[float] | None = None,
        prefill_ms: float = 0.0,
    ) -> None:
        self.requests, self.closed_loop = requests, closed_loop
        self.segments, self.think_ms = segments, think_ms
        self.window_ms = window_ms if closed_loop else None
        self.prefill_ms = prefill_ms if self.window_ms is not None else 0.0
        self.queues: dict[str | None, deque[int]] = {}  # by client (closed loop), else one queue
        for i, r in enumerate(requests):
            self.queues.setdefault(r.client if closed_loop else None, deque()).append(i)
        self.clock = 0.0
        self.num_admitted = 0  # requests sent (windows: some again, some never)
        self.busy: set[str] = set()  # clients with a request running
        self.segment = 0  # the busy period being served
        self.ready_at: dict[int, float] = {}  # request index -> the clock it may join at (think_ms)
        self.opened: float | None = None  # the clock at the period's first admission (windows)
        self.idle_ms = 0.0  # the clock's idle waits since then (not in the window: live had no steps)
        self.sent: set[str] = set()  # clients that sent a request in the period (windows)
        self.turns: dict[tuple[str, int], int] = {}  # requests sent again per (client, period)
        self.again: dict[tuple[str, int], list[int]] = {}  # per (client, period): its requests there
        if self.window_ms is not None:
            for i, r in enumerate(requests):
                if r.client is not None and r.output_len > 1:  # one that takes decode steps (and clock)
                    self.again.setdefault((r.client, self.period_of(i)), []).append(i)

    @property
    def has_work(self) -> bool:
        return any(self.queues.values())

    def period_of(self, i: int) -> int:
        return self.segments[i] if self.segments is not None else 0

    def is_waiting(self, i: int) -> bool:
        return self.think_ms is not None and self.ready_at.get(i, 0.0) > self.clock

    @property
    def is_open(self) -> bool:
        """The period's clients still send (windows)."""
        w = self.window_ms
        return w is None or self.opened is None or self.clock - self.opened - self.idle_ms <= w[self.segment]

    def admit(self, num_slots: int, is_drained: bool) -> list[int]:
        """The requests that join now (indices into ``requests``), at most ``num_slots`` of them that
        take decode steps (``output_len`` > 1; the others join and finish at once); ``is_drained``:
        nothing runs, so the next busy period may start."""
        if is_drained:
            self._next_period()
        is_open = self.is_open
        if is_open:
            self._send_again()
        out: list[int] = []
        is_admitted = True
        while is_admitted and num_slots > 0:
            is_admitted = False
            for client, queue in self.queues.items():
                if num_slots <= 0 or not self._may_join(client, queue, is_open):
                    continue
                i = queue.popleft()
                out.append(i)
                self.num_admitted += 1
                if self.opened is None:
                    self.opened, self.idle_ms = self.clock, 0.0
                self.clock += self.prefill_ms
                if client is not None:
                    self.sent.add(client)
                if self.requests[i].output_len > 1:
                    num_slots -= 1
                    if client is not None:
                        self.busy.add(client)
                is_admitted = True
        return out

    def _may_join(self, client: str | None, queue: deque[int], is_open: bool) -> bool:
        """The head of ``client``'s queue may join now (a slot given): the client has none running,
        its period has come, its round trip is over, and the period's window is open or this is the
        client's first request of the period."""
        if not queue or client in self.busy or self.period_of(queue[0]) > self.segment:
            return False
        return not self.is_waiting(queue[0]) and (is_open or client not in self.sent)

    @property
    def has_waiting(self) -> bool:
        """A request that could join now is held for lack of a slot (call after :meth:`admit`): the
        engine's ``scheduler.waiting``, which stops a run of plain steps (policies/replay_runs.py)."""
        is_open = self.is_open
        return any(self._may_join(client, queue, is_open) for client, queue in self.queues.items())

    def finish(self, i: int) -> None:
        """Request ``i`` finished: its client may send its next one, after its round trip."""
        client = self.requests[i].client if self.closed_loop else None
        self.busy.discard(client)
        queue = self.queues.get(client)
        if self.think_ms is not None and queue:
            self.ready_at[queue[0]] = self.clock + self.think_ms[queue[0]]

    def wait(self) -> None:
        """Nothing runs and nobody is ready: the clock moves to the first client's round trip's end."""
        waits = [self.ready_at[q[0]] for q in self.queues.values() if q and self.is_waiting(q[0])]
        if waits:
            t = min(waits)
            self.idle_ms += max(t - self.clock, 0.0)
            self.clock = t

    def _next_period(self) -> None:
        if not self.is_open:  # its window closed: what its clients had not sent stays unsent
            for client, q in self.queues.items():
                while client in self.sent and q and self.period_of(q[0]) == self.segment:
                    q.popleft()
        if self.segments is not None:
            nxt = min((self.segments[q[0]] for q in self.queues.values() if q), default=self.segment)
            if nxt != self.segment:
                self.opened, self.segment = None, nxt
                self.sent.clear()

    def _send_again(self) -> None:
        """A client done with its requests of an open window sends them again, in order."""
        for client, queue in self.queues.items():
            key = (client, self.segment)
            if key not in self.again or client in self.busy:
                continue
            if not (queue and self.period_of(queue[0]) == self.segment):
                n = self.turns[key] = self.turns.get(key, 0) + 1
                i = self.again[key][(n - 1) % len(self.again[key])]
                queue.appendleft(i)
                if self.think_ms is not None:  # its client's round trip, as when it was sent live
                    self.ready_at[i] = self.clock + self.think_ms[i]
