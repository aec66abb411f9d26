"""The engine thread's side of the daemon: wire requests in, ``chunk`` / ``done`` messages out.

The IO thread (server.py) hands over commands (commands.py: :class:`Admit`, :class:`CancelRequest`,
:class:`DropClient`, :class:`Shutdown`) through a queue; :class:`Serving` drains them between engine
steps (continuous batching), admits requests (admission.py: tokenizing, the limits that need the
tokenizer or the engine), tracks each one's text and stop strings (request_stream.py), and turns each
step's :class:`RequestOutput` s into messages for the IO thread as soon as the step ends (outputs.py:
:class:`ServingOutputs`, its output half). It also runs each request's deadline (``generate.timeout``,
``daemon.request_timeout_s``) and keeps the counters of ``stats`` (stats.py).

With a durable decision log (``log.durable``, the default), a request's last message (``done``, or the
``error`` of a failed step) is held in :class:`HeldReplies` until the log's writer thread has committed
the request's row, and released from that thread; chunks stream as before. The engine thread never
waits for the disk (only at shutdown, where it flushes the log so that every held reply leaves). The
outbox carries lists of ``(client, message)``: one per loop iteration from the engine thread (a step's
chunks in one queue put), one per release from the writer thread.
"""

from __future__ import annotations

import heapq
import logging
import queue
import time
from collections import defaultdict
from collections.abc import Callable

from specsched.daemon.admission import build_request, engine_error, request_key
from specsched.daemon.commands import Admit, CancelRequest, Command, DropClient, Shutdown
from specsched.daemon.held_replies import HeldReplies, Outgoing
from specsched.daemon.messages import Error, ErrorCode, Message, ProtocolError, StatsReply
from specsched.daemon.outputs import ServingOutputs
from specsched.daemon.request_stream import RequestStream
from specsched.daemon.stats_reply import SnapshotBuilder
from specsched.engine.log_schema import prompt_hash
from specsched.engine.records import RequestOutput
from specsched.engine.request import FinishReason
from specsched.engine.stats import EngineStats
from specsched.models.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)
__all__ = ["Admit", "CancelRequest", "Command", "DropClient", "Serving", "Shutdown"]


class Serving(ServingOutputs):
    """Runs on the engine thread; owns the engine. ``send(client, msg)`` adds a message to this loop
    iteration's list, ``flush()`` posts that list to the IO thread's outbox in one piece (``post``: one
    queue put per step, not one per chunk; the IO thread sends the list in order) and wakes it
    (``wake``); a request's last reply goes to :class:`HeldReplies` only after the list with its chunks."""

    def __init__(
        self, engine, cfg, post: Callable[[list[Outgoing]], None], wake: Callable[[], None], log=None
    ) -> None:
        self.engine, self.cfg, self.post, self.wake, self.log = engine, cfg, post, wake, log
        self._out: list[Outgoing] = []  # this iteration's messages, in order
        self._finals: list[tuple[int, bytes, Message]] = []  # last replies for HeldReplies, after _out
        self.streams: dict[str, RequestStream] = {}  # engine request id -> stream
        self.by_client: dict[bytes, set[str]] = defaultdict(set)
        self.step_stats = EngineStats(cfg.stats_window_s)
        self.counts = {"done": 0, "aborted": 0, "errored": 0, "rejected": 0, "timed_out": 0}
        self.deadlines: list[tuple[float, str]] = []  # heap of (deadline, stream key)
        self.snapshot = StatsReply()  # replaced (not mutated) after every loop iteration
        self._snapshots = SnapshotBuilder()
        self._deadline: float | None = None  # shutdown: abort what is left at this monotonic time
        self._is_log_broken = False
        self._chained_on_step = None  # an on_step callback the engine had before serving started
        is_durable = log is not None and getattr(log, "is_durable", False)
        self.held = HeldReplies(log, post, wake) if is_durable else None
        # log.pace=step: the writer takes its records while the engine waits for the device, and when
        # the engine idles (LogWriter.nudge); log.pace=record: nothing on the step's path
        self._nudge_log = log.nudge if getattr(log, "is_paced", False) else None
        # daemon.send_pace=step: the IO thread is woken for what flush posted at the next step's
        # device wait (or at the next flush, if no step waited for the device since)
        self.is_send_paced = getattr(cfg, "send_pace", "loop") == "step"
        self._is_wake_due = False  # posted, the IO thread not woken for it yet (send_pace=step)
        if self.is_send_paced:
            engine.on_device_wait = self._on_device_wait
        elif self._nudge_log is not None:
            engine.on_device_wait = self._nudge_log
        # daemon.output_pace=window: a step's outputs wait for the next step's forward and are handled
        # there (engine.on_host_window), while the device works instead of idling; the engine completes
        # the step's record there too (engine.is_record_deferred: its rows, stats, on_step)
        pace = getattr(cfg, "output_pace", "loop")
        self.is_output_deferred = pace == "window" or (
            pace == "auto" and getattr(engine, "is_overlapped_observe", False)
        )
        self._pending: list[RequestOutput] = []  # the last step's outputs, for the next window
        self._pending_time = 0.0  # time.time() when that step returned (its tokens' arrival)
        self._is_in_window = False  # handling outputs inside an engine step: no abort_request there
        self._stop_hits: list[str] = []  # requests a stop string ended in the window: aborted after it
        if self.is_output_deferred:
            engine.on_host_window = self._on_host_window
            engine.is_record_deferred = True

    def send(self, client: bytes, msg: Message) -> None:
        self._out.append((client, msg))

    def flush(self) -> None:
        """Post this iteration's messages, then hand its last replies to HeldReplies; wake the IO thread
        when anything was posted."""
        out, finals = self._out, self._finals
        if out:
            self._out = []
            self.post(out)
        if finals:
            self._finals = []
            self.held.send_after(finals)
        if not (out or finals or self._is_wake_due):
            return
        # paced: while a step follows at once, its device wait wakes the IO thread; a wake still due
        # from the last flush (no device wait since) goes now
        if (
            self.is_send_paced
            and not self._is_wake_due
            and self.engine.has_unfinished
            and self._deadline is None
        ):
            self._is_wake_due = True
        else:
            self._is_wake_due = False
            self.wake()

    def _on_device_wait(self) -> None:
        """The engine waits for the device (send_pace=step): wake the IO thread for what was posted,
        and nudge a step-paced log."""
        if self._is_wake_due:
            self._is_wake_due = False
            self.wake()
        if self._nudge_log is not None:
            self._nudge_log()

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self, inbox: queue.Queue) -> None:
        """Drain commands, step, publish; returns once a :class:`Shutdown` has been carried out."""
        idle_s = self.cfg.idle_sleep_ms / 1e3
        self._chained_on_step, self.engine.on_step = self.engine.on_step, self._on_step
        try:
            while True:
                is_idle = not self.engine.has_unfinished and self._deadline is None
                if is_idle and self._nudge_log is not None:
                    self._nudge_log()  # the last steps' records (and their requests' dones) go out now
                try:
                    self._handle_safely(inbox.get(timeout=idle_s) if is_idle else inbox.get_nowait())
                    while True:
                        self._handle_safely(inbox.get_nowait())
                except queue.Empty:
                    pass
                if self._out or self._finals:  # replies to commands (rejections...) leave before the step
                    self.flush()
                if self._deadline is not None and (
                    not self.engine.has_unfinished or time.monotonic() >= self._deadline
                ):
                    self.abort_all(FinishReason.ABORT)
                    self.publish()
                    return
                self.expire()
                if self.engine.has_unfinished:
                    self.step()
                self.publish()
                self.flush()
        finally:
            self.drain()
            self._flush_record()
            self.flush()
            self.release_held()
            self.wake()

    def release_held(self) -> None:
        """Shutdown (or a dying engine thread): commit the log, then let every held reply go, whether
        or not the commit worked (the IO thread sends them before it stops)."""
        if self.held is not None and len(self.held):
            self._log_call(self.log.flush)
            self.held.release_all()

    def _handle_safely(self, cmd: Command) -> None:
        try:
            self.handle(cmd)
        except Exception:  # noqa: BLE001 -- one bad command must not stop the engine thread
            logger.exception("handling %s failed", type(cmd).__name__)

    def handle(self, cmd: Command) -> None:
        if isinstance(cmd, Admit):
            self.admit(cmd)
            return
        self.drain()  # a cancel, drop or shutdown comes after the outputs the last step produced
        if isinstance(cmd, CancelRequest):
            st = self.streams.get(request_key(cmd.client, cmd.id))
            if st is not None:  # else it finished meanwhile; its done is on the way
                self.engine.abort_request(st.key, FinishReason.ABORT)
                self._finish(st, FinishReason.ABORT.value)
        elif isinstance(cmd, DropClient):
            for key in list(self.by_client.get(cmd.client, ())):
                self.engine.abort_request(key, FinishReason.ABORT)
                self._finish(self.streams[key], FinishReason.ABORT.value, reply=False)
        elif isinstance(cmd, Shutdown):
            deadline = time.monotonic() + cmd.grace_s
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 -- a failed step fails its requests, not the daemon
            logger.exception("engine step failed; failing all %d in-flight requests", len(self.streams))
            self._stop_hits.clear()
            self.abort_all(FinishReason.ERROR, error=f"engine step failed: {type(e).__name__}: {e}")
            return
        for key in self._stop_hits:  # stop strings found in this step's window end their requests now
            self.engine.abort_request(key, FinishReason.STOP)
        self._stop_hits.clear()
        self.drain()  # what no window took (a call that ran no forward)
        now = time.time()
        if self._is_deferring:
            self._pending, self._pending_time = outputs, now
            return
        for out in outputs:
            self._on_output(out, now)

    @property
    def _is_deferring(self) -> bool:
        """A step's outputs wait for the next step's window: output_pace=window while a next step
        follows (idle or shutting down, they are handled at once)."""
        return self.is_output_deferred and self.engine.has_unfinished and self._deadline is None

    def drain(self) -> None:
        """Handle the outputs the last step left for the window."""
        if self._pending:
            outputs, self._pending = self._pending, []
            for out in outputs:
                self._on_output(out, self._pending_time)

    def _flush_record(self) -> None:
        """The last step's record, deferred by the engine, to the log now (no step follows)."""
        if getattr(self.engine, "is_record_deferred", False):
            self._log_call(self.engine.flush_record)

    def _on_host_window(self) -> None:
        """The engine's forward runs (output_pace=window): handle the last step's outputs and post the
        replies (paced sends still go at this step's device wait)."""
        self._is_in_window = True
        try:
            self.drain()
            if self._out or self._finals:
                self.flush()
        except Exception:  # noqa: BLE001 -- the step must go on; the failure is the daemon's, not the engine's
            logger.exception("handling a step's outputs in the next step's window failed")
        finally:
            self._is_in_window = False

    def expire(self) -> None:
        """Finish every request whose deadline passed (``done`` with finish_reason ``timeout``)."""
        now = time.monotonic()
        if self.deadlines and self.deadlines[0][0] <= now:
            self.drain()  # a request that finished in the last step is done, not timed out
        while self.deadlines and self.deadlines[0][0] <= now:
            _, key = heapq.heappop(self.deadlines)
            st = self.streams.get(key)
            if st is not None and st.deadline is not None and st.deadline <= now:  # not a reused key
                self.engine.abort_request(key, FinishReason.TIMEOUT)
                self._finish(st, FinishReason.TIMEOUT.value)

    def publish(self) -> None:
        """The stats snapshot the IO thread answers from (stats_reply.SnapshotBuilder: the counts every
        iteration, the engine-wide figures at most every 50 ms while busy)."""
        self.snapshot = self._snapshots.build(self.engine, self.counts, len(self.streams), self.step_stats)

    def abort_all(self, reason: FinishReason, error: str | None = None) -> None:
        self.drain()  # what the last step produced goes out first
        self._flush_record()
        for st in list(self.streams.values()):
            try:
                self.engine.abort_request(st.key, reason)
            except Exception:  # noqa: BLE001 -- the engine may be broken; still answer the client
                logger.exception("aborting %s failed", st.key)
            self._finish(st, reason.value, error=error)

    # ---- admission --------------------------------------------------------------------------------
    def admit(self, cmd: Admit) -> None:
        msg = cmd.msg
        try:
            req = build_request(cmd, self.engine, self.cfg)
            try:
                self.engine.add_request(req)
            except ValueError as e:
                raise engine_error(e, msg.id) from None
        except Exception as e:  # noqa: BLE001 -- every request gets an answer
            if not isinstance(e, ProtocolError):
                logger.exception("admitting %r failed", msg.id)
                e = ProtocolError(ErrorCode.INTERNAL, f"admission failed: {type(e).__name__}: {e}", msg.id)
            self.counts["rejected"] += 1
            self.send(cmd.client, Error(msg.id, e.code.value, e.message))
            return
        tok = self.engine.tokenizer
        timeout = msg.timeout if msg.timeout is not None else self.cfg.request_timeout_s
        st = RequestStream(
            cmd.client,
            msg.id,
            req.request_id,
            msg.stream,
            list(msg.stop),
            len(req.prompt_ids),
            cmd.arrival_time,
            IncrementalDetokenizer(tok) if tok is not None else None,
            deadline=None if timeout is None else cmd.received + timeout,
            prompt_hash=prompt_hash(req.prompt_ids) if self.log is not None else None,
        )
        self.streams[st.key] = st
        if st.deadline is not None:
            heapq.heappush(self.deadlines, (st.deadline, st.key))
        self.by_client[cmd.client].add(st.key)
