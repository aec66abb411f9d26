"""SQLite decision log (sqlite-utils, WAL): one row per run, request, step and request-in-step.

The engine thread only enqueues (``put_nowait``; a full queue drops and counts); a background thread
owns the connection (log_store.py) and writes in batches, one transaction per flush. Every record
enqueued gets a sequence number (1, 2, ...; FIFO, so committing record n commits every record before
it); after each write the writer thread publishes :attr:`LogWriter.settled_seq` and calls the
:meth:`LogWriter.on_settled` listeners, which is how serving holds a request's ``done`` until its row
is committed (``log.durable``: group commit, a finished request's row starts a write within
``log.commit_interval_ms``). A failed write (disk full, read-only file, locked database) is counted and
reported once; serving continues and later flushes retry. The schema and the reader :func:`open_log`
are in log_schema.py (re-exported here); docs/logging.md documents the tables.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specsched.daemon.log_config import LogConfig
from specsched.daemon.log_store import LogStore
from specsched.engine.log_schema import (
    SCHEMA_SQL,
    SCHEMA_VERSION,
    STEP_FIELDS,
    STEP_REQUEST_FIELDS,
    LogFormatError,
    open_log,
    to_json,
)
from specsched.engine.records import StepRecord

logger = logging.getLogger(__name__)
__all__ = [
    "SCHEMA_SQL",
    "SCHEMA_VERSION",
    "STEP_FIELDS",
    "STEP_REQUEST_FIELDS",
    "LogConfig",
    "LogFormatError",
    "LogWriter",
    "open_log",
]


@dataclass
class _Control:
    """A queue marker: flush, start a run (``run_row``), end it (``run_end``: the run row's closing
    fields), save cost models (``costs``), or stop. The writer sets ``done``."""

    kind: str  # "flush" | "run" | "end" | "costs" | "stop"
    run_row: dict | None = None
    run_end: dict | None = None
    costs: object | None = None  # a CostModels copy: its save(db, run_id) writes the cost_models rows
    ok: bool = False
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class LogWriter:
    """Writes the decision log from a background thread. Serving-side calls never block on disk and
    never raise on a write failure. One run per writer: call :meth:`start_run` first."""

    def __init__(self, cfg: LogConfig):
        if cfg.path is None:
            raise ValueError("LogWriter needs log.path (log.path=null means: do not create a LogWriter)")
        self.cfg = cfg
        self.path = str(cfg.path)
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.queue_max)
        self._lock = threading.Lock()  # guards the counters written from the serving threads
        self._num_dropped = 0
        self._put_lock = threading.Lock()  # a sequence number and its place in the queue go together
        self._num_enqueued = 0  # the sequence number of the latest record on the queue
        self._num_taken = 0  # writer thread: records taken off the queue (the same numbering)
        self._settled_seq = 0  # records 1..settled_seq are committed, or failed/dropped and counted
        self._listeners: list[Callable[[int], None]] = []
        self._is_listener_broken = False
        self._is_closed = False
        self._run_started = False
        self._store = LogStore(self.path, cfg, self._drop)  # the writer thread's state
        self._nudge = threading.Event()  # log.pace=step: the engine waits for the device (nudge)
        self._thread = threading.Thread(target=self._loop, name="specsched-log", daemon=True)
        self._thread.start()

    # ---- serving side -------------------------------------------------------------------------------
    @property
    def native_id(self) -> int | None:
        """The writer thread's kernel id (daemon/host_stats.py reads its CPU time)."""
        return self._thread.native_id

    def start_run(
        self, config: dict, model: str, device: str, version: str, timeout: float = 10.0
    ) -> int | None:
        """Insert this run's row (waits for the writer). Returns its id, or None when the log cannot be
        written right now (counted and reported; the row is retried with the next flush). Raises
        :class:`LogFormatError` when the file is not a log of this schema version."""
        if self._run_started:
            raise RuntimeError("start_run was already called on this LogWriter (one run per writer)")
        self._run_started = True
        row = {
            "started_at": time.time(),
            "config": to_json(config),
            "model": model,
            "device": device,
            "version": version,
            "schema_version": SCHEMA_VERSION,
        }
        ctl = self._control("run", timeout, run_row=row)
        if isinstance(ctl.error, LogFormatError):
            raise ctl.error
        return self._store.run_id

    def write_step(self, record: StepRecord) -> int | None:
        """Enqueue one step (→ ``steps`` + ``step_requests``); returns its sequence number (None: dropped).
        The record must not be mutated afterwards."""
        return self._put(record)

    def write_request(
        self,
        request_id: str,
        *,
        client: bytes | str | None,
        arrival: float,
        first_token_time: float | None,
        finish_time: float,
        prompt_tokens: int,
        output_tokens: int,
        finish_reason: str | None,
        proposed: int,
        accepted: int,
        prompt_hash: str | None = None,
    ) -> int | None:
        """Enqueue one finished request (→ ``requests``); returns its sequence number (None: dropped,
        counted). Times are ``time.time()`` seconds; ``prompt_hash``: ``engine.log_schema.prompt_hash``
        of its prompt's token ids (the replay pools the match bits of one prompt's lives). With
        ``log.durable`` it is committed (with all that was enqueued before it: the request's steps)
        within about ``log.commit_interval_ms``."""
        return self._put(
            {
                "request_id": request_id,
                "client": client.hex() if isinstance(client, bytes) else client,
                "arrival": arrival,
                "first_token_time": first_token_time,
                "finish_time": finish_time,
                "prompt_tokens": prompt_tokens,
                "output_tokens": output_tokens,
                "finish_reason": None
                if finish_reason is None
                else str(getattr(finish_reason, "value", finish_reason)),
                "proposed": proposed,
                "accepted": accepted,
                "prompt_hash": prompt_hash,
            }
        )

    @property
    def is_paced(self) -> bool:
        """``log.pace=step``: the writer takes records only when nudged (or at the flush interval)."""
        return self.cfg.pace == "step"

    def nudge(self) -> None:
        """``log.pace=step``: the engine thread is about to wait for the device (or to idle): the writer
        takes what is queued now, while the engine needs no interpreter lock. A no-op otherwise."""
        if self.is_paced:
            self._nudge.set()

    def end_run(self, num_compiles_after_start: int, timeout: float = 10.0) -> bool:
        """Close this run's row: ``ended_at`` and the Triton variants built while serving (written with
        the next write; True when it is on disk within ``timeout``)."""
        if self._is_closed or not self._run_started:
            return False
        end = {"ended_at": time.time(), "num_compiles_after_start": int(num_compiles_after_start)}
        return self._control("end", timeout, run_end=end).ok

    def save_costs(self, costs, timeout: float = 10.0) -> bool:
        """Write a copy of the engine's cost models (``CostModels``) to the ``cost_models`` table under
        this run: its coefficients and the graph buckets a replay pads to (without them a replay of
        this log prices every scorer unpadded). Copied here (so the engine may learn on afterwards):
        call it while the engine is not stepping (start-up, shutdown). True when on disk within
        ``timeout``."""
        if self._is_closed or not self._run_started:
            return False
        return self._control("costs", timeout, costs=copy.deepcopy(costs)).ok

    def flush(self, timeout: float = 10.0) -> bool:
        """Write everything enqueued so far. True when it is on disk within ``timeout``."""
        if self._is_closed:
            return self._store.fatal is None and not self._store.has_pending
        return self._control("flush", timeout).ok

    def close(self, timeout: float = 10.0) -> None:
        """Flush and stop the writer thread (idempotent)."""
        if self._is_closed:
            return
        self._is_closed = True
        self._control("stop", timeout)
        self._thread.join(timeout)

    def on_settled(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(settled_seq)`` on the writer thread after every write attempt (and at close).
        It must be quick and must not block: it runs between two commits."""
        self._listeners.append(listener)

    @property
    def settled_seq(self) -> int:
        """Records 1..settled_seq are settled: committed to the file, or their write failed (counted in
        ``num_failures``; they stay queued for a retry) or they were dropped (``num_dropped``)."""
        return self._settled_seq

    @property
    def is_durable(self) -> bool:
        return self.cfg.durable

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def run_id(self) -> int | None:
        return self._store.run_id

    @property
    def num_failures(self) -> int:
        return self._store.num_failures

    @property
    def num_dropped(self) -> int:
        return self._num_dropped

    @property
    def num_written_steps(self) -> int:
        return self._store.num_written_steps

    @property
    def last_error(self) -> str | None:
        return self._store.last_error

    def _put(self, item) -> int | None:
        if not self._run_started:
            raise RuntimeError("call LogWriter.start_run before writing steps or requests")
        if self._is_closed:
            self._drop()
            return None
        if self._queue.qsize() + self._store.num_pending >= self.cfg.queue_max:
            self._drop()  # log.queue_max bounds the queue and the retry buffer together
            return None
        with self._put_lock:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                pass
            else:
                self._num_enqueued += 1
                return self._num_enqueued
        self._drop()
        return None

    def _drop(self, n: int = 1, quiet: bool = False) -> None:
        with self._lock:
            self._num_dropped += n
            first = self._num_dropped == n and not quiet
        if first:
            logger.warning(
                "decision log %s: dropping records (queue or retry buffer full, or writer closed); "
                "counted in num_dropped, reported once",
                self.path,
            )

    def _control(
        self,
        kind: str,
        timeout: float,
        run_row: dict | None = None,
        run_end: dict | None = None,
        costs: object | None = None,
    ) -> _Control:
        """Queue a control and wait up to ``timeout`` for the writer to carry it out (``ok``)."""
        ctl = _Control(kind, run_row, run_end, costs)
        try:
            self._queue.put(ctl, timeout=timeout)
        except queue.Full:
            return ctl
        self._nudge.set()  # log.pace=step: a control does not wait for the engine's nudge
        ctl.done.wait(timeout)
        return ctl

    # ---- writer thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Take records until the flush interval ends, ``batch_size`` are waiting or a control arrives;
        with ``durable``, a request row shortens the wait to the next commit slot (group commit: at
        most one write per ``commit_interval_ms``, with everything queued by then). Write, settle.
        ``log.pace=step``: :meth:`_take_paced` instead."""
        cfg, store = self.cfg, self._store
        commit_s = cfg.commit_interval_ms / 1e3
        last_write = -commit_s
        last_flush = time.monotonic()
        while True:
            controls: list[_Control] = []
            if self.is_paced:
                num_new, is_due = self._take_paced(controls, last_write + commit_s, last_flush)
            else:
                num_new, is_due = self._take_each(controls, last_write + commit_s), True
            self._num_taken += num_new
            if not is_due:  # buffered, not committed: nothing settles until the write
                continue
            last_flush = time.monotonic()
            for ctl in controls:
                if ctl.run_row is not None:
                    store.run_row = ctl.run_row
                if ctl.run_end is not None:
                    store.run_end = ctl.run_end
                if ctl.costs is not None:
                    store.costs = ctl.costs
            ok = True
            if num_new or controls or store.has_pending:
                last_write = time.monotonic()
                ok = store.write()
            for ctl in controls:
                if ctl.kind == "stop":
                    store.discard_pending()  # what the last write could not store is lost: count it
                    store.close()
            self._settle()
            for ctl in controls:
                ctl.ok, ctl.error = ok, store.fatal
                ctl.done.set()
                if ctl.kind == "stop":
                    return

    def _take_each(self, controls: list[_Control], commit_at: float) -> int:
        """``log.pace=record``: buffer each record as it arrives, until the flush interval ends,
        ``batch_size`` are taken, a control comes or (durable) a request row's commit slot
        (``commit_at``, or now) is reached. Returns the number taken."""
        cfg, store = self.cfg, self._store
        deadline = time.monotonic() + cfg.flush_interval_s
        num_new = 0
        while num_new < cfg.batch_size and not controls:
            remaining = deadline - time.monotonic()
            try:  # past the deadline: still take what is queued already, without waiting
                item = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Control):
                controls.append(item)
                continue
            store.buffer(item)
            num_new += 1
            if cfg.durable and isinstance(item, dict):  # a finished request: its done is waiting
                deadline = min(deadline, max(time.monotonic(), commit_at))
        return num_new

    def _take_paced(self, controls: list[_Control], commit_at: float, last_flush: float) -> tuple[int, bool]:
        """``log.pace=step``: wait for :meth:`nudge` (the engine's device wait, or a control) or the
        flush interval, then buffer everything queued. Returns (number taken, whether to write now:
        a control, ``batch_size`` buffered, the flush interval over, or (durable) a request row whose
        commit slot ``commit_at`` has come; else the next nudge writes it)."""
        cfg, store = self.cfg, self._store
        self._nudge.wait(max(0.0, last_flush + cfg.flush_interval_s - time.monotonic()))
        self._nudge.clear()
        num_new = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Control):
                controls.append(item)
            else:
                store.buffer(item)
                num_new += 1
        now = time.monotonic()
        is_due = (
            bool(controls)
            or store.num_pending >= cfg.batch_size
            or now >= last_flush + cfg.flush_interval_s
            or (cfg.durable and store.has_requests and now >= commit_at)
        )
        return num_new, is_due

    def _settle(self) -> None:
        """Publish how far the queue is settled and tell the listeners (serving releases held dones)."""
        if self._num_taken == self._settled_seq:
            return
        self._settled_seq = self._num_taken
        for listener in self._listeners:
            try:
                listener(self._settled_seq)
            except Exception:  # noqa: BLE001 -- a listener's bug must not stop the writer
                if not self._is_listener_broken:
                    self._is_listener_broken = True
                    logger.exception("decision log %s: a settle listener failed (reported once)", self.path)
