"""SQLite decision log (sqlite-utils, WAL): one row per run, request, step and request-in-step.

The engine thread only enqueues (``put_nowait``; a full queue drops and counts); a background thread
owns the connection and writes in batches, one transaction per flush. A failed write (disk full,
read-only file, locked database) is counted and reported once; serving continues and later flushes
retry. The schema is documented in docs/logging.md.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass, field

import sqlite_utils

from specsched.daemon.records import StepRecord

SCHEMA_VERSION = 1  # bump on any change to the tables below; readers refuse other versions

logger = logging.getLogger(__name__)

TABLES: dict[str, dict[str, type]] = {
    "runs": {"id": int, "started_at": float, "config": str, "model": str, "device": str, "version": str,
             "schema_version": int},
    "requests": {"run_id": int, "request_id": str, "client": str, "arrival": float, "first_token_time": float,
                 "finish_time": float, "prompt_tokens": int, "output_tokens": int, "finish_reason": str,
                 "proposed": int, "accepted": int},
    "steps": {"run_id": int, "step": int, "kind": str, "start_time": float, "batch_size": int, "num_tokens": int,
              "scorer": str, "policy": str, "proposer": str, "is_synthetic": bool,
              "predicted_propose_ms": float, "predicted_score_ms": float, "predicted_verify_ms": float,
              "predicted_ms": float, "propose_ms": float, "score_ms": float, "verify_ms": float,
              "total_ms": float, "num_emitted": int, "plan_info": str},
    "step_requests": {"run_id": int, "step": int, "request_id": str, "context_len": int, "k": int,
                      "num_accepted": int, "match_bits": str},
}
INDEXES = {"requests": ["run_id", "request_id"], "steps": ["run_id", "step"], "step_requests": ["run_id", "step"]}


class LogFormatError(Exception):
    """The file is not a specsched log of this schema version (or not SQLite at all)."""


@dataclass
class LogConfig:
    path: str | None = None  # SQLite file; None = no log
    flush_interval_s: float = 0.5  # longest a record waits in memory (what a crash can lose)
    batch_size: int = 256  # records that trigger a write before the interval ends
    queue_max: int = 100_000  # records held in memory at most (queue + retry buffer); more are dropped
    busy_timeout_s: float = 1.0  # wait for a locked database before counting the write as failed

    def __post_init__(self) -> None:
        if self.path is not None and not str(self.path).strip():
            raise ValueError("log.path must be a file path or null (no log), got an empty string")
        if not self.flush_interval_s > 0:
            raise ValueError(f"log.flush_interval_s must be > 0, got {self.flush_interval_s}")
        if self.batch_size < 1:
            raise ValueError(f"log.batch_size must be >= 1, got {self.batch_size}")
        if self.queue_max < self.batch_size:
            raise ValueError(f"log.queue_max must be >= log.batch_size ({self.batch_size}), got {self.queue_max}")
        if self.busy_timeout_s < 0:
            raise ValueError(f"log.busy_timeout_s must be >= 0, got {self.busy_timeout_s}")


def _check_schema(db: sqlite_utils.Database, path: str, allow_new: bool) -> None:
    """Raise :class:`LogFormatError` unless ``db`` is a specsched log of :data:`SCHEMA_VERSION`
    (or, with ``allow_new``, an empty database)."""
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = set(db.table_names())
    except sqlite3.OperationalError:
        raise
    except sqlite3.DatabaseError as e:  # "file is not a database", "malformed"
        raise LogFormatError(f"{path}: not a readable SQLite file ({e})") from e
    if version == SCHEMA_VERSION and "runs" in tables:
        return
    if version == 0 and not tables and allow_new:
        return
    if version == 0:
        raise LogFormatError(f"{path}: not a specsched log (no schema version; tables: {sorted(tables)})")
    raise LogFormatError(f"{path}: log schema version {version}, this specsched reads version {SCHEMA_VERSION}")


def open_log(path: str | os.PathLike) -> sqlite_utils.Database:
    """Open an existing log for reading (replay, analysis); checks it is a log of this schema version."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LogFormatError(f"{path}: no such log file")
    try:
        db = sqlite_utils.Database(path)
        _check_schema(db, path, allow_new=False)
    except sqlite3.Error as e:
        raise LogFormatError(f"{path}: cannot read log ({e})") from e
    return db


def _json(obj) -> str:
    def default(x):
        return x.item() if hasattr(x, "item") else str(x)  # numpy / torch scalars, enums, ...

    return json.dumps(obj, default=default)


def _step_rows(r: StepRecord) -> tuple[dict, list[dict]]:
    plan_info = getattr(r, "plan_info", None)
    step = {
        "step": r.step, "kind": r.kind, "start_time": r.start_time, "batch_size": r.batch_size,
        "num_tokens": r.num_tokens, "scorer": r.scorer, "policy": r.policy, "proposer": r.proposer,
        "is_synthetic": bool(r.is_synthetic), "predicted_propose_ms": r.predicted_propose_ms,
        "predicted_score_ms": r.predicted_score_ms, "predicted_verify_ms": r.predicted_verify_ms,
        "predicted_ms": r.predicted_ms, "propose_ms": r.propose_ms, "score_ms": r.score_ms,
        "verify_ms": r.verify_ms, "total_ms": r.total_ms, "num_emitted": r.num_emitted,
        "plan_info": _json(plan_info) if plan_info else None,
    }
    reqs = [{"step": r.step, "request_id": q.request_id, "context_len": q.context_len, "k": q.k,
             "num_accepted": q.num_accepted, "match_bits": q.match_bits} for q in r.requests]
    return step, reqs


@dataclass
class _Control:
    """A queue marker: flush (``run_row`` None), start a run, or stop. The writer sets ``done``."""

    kind: str  # "flush" | "run" | "stop"
    run_row: dict | None = None
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
        self._num_failures = 0
        self._num_written_steps = 0
        self._last_error: str | None = None
        self._is_reported = False
        self._is_closed = False
        self._run_started = False
        self._run_id: int | None = None
        self._run_row: dict | None = None  # until written
        self._fatal: LogFormatError | None = None
        self._db: sqlite_utils.Database | None = None
        # writer-thread state: rows awaiting a successful write (run_id stamped at write time)
        self._steps: list[dict] = []
        self._step_requests: list[dict] = []
        self._requests: list[dict] = []
        self._thread = threading.Thread(target=self._loop, name="specsched-log", daemon=True)
        self._thread.start()

    # ---- serving side -------------------------------------------------------------------------------
    def start_run(self, config: dict, model: str, device: str, version: str, timeout: float = 10.0) -> int | None:
        """Insert this run's row (waits for the writer). Returns its id, or None when the log cannot be
        written right now (counted and reported; the row is retried with the next flush). Raises
        :class:`LogFormatError` when the file is not a log of this schema version."""
        if self._run_started:
            raise RuntimeError("start_run was already called on this LogWriter (one run per writer)")
        self._run_started = True
        row = {"started_at": time.time(), "config": _json(config), "model": model, "device": device,
               "version": version, "schema_version": SCHEMA_VERSION}
        ctl = self._control("run", timeout, run_row=row)
        if isinstance(ctl.error, LogFormatError):
            raise ctl.error
        return self._run_id

    def write_step(self, record: StepRecord) -> None:
        """Enqueue one step (→ ``steps`` + ``step_requests``). The record must not be mutated afterwards."""
        self._put(record)

    def write_request(self, request_id: str, *, client: bytes | str | None, arrival: float,
                      first_token_time: float | None, finish_time: float, prompt_tokens: int,
                      output_tokens: int, finish_reason: str | None, proposed: int, accepted: int) -> None:
        """Enqueue one finished request (→ ``requests``). Times are ``time.time()`` seconds."""
        self._put({"request_id": request_id, "client": client.hex() if isinstance(client, bytes) else client,
                   "arrival": arrival, "first_token_time": first_token_time, "finish_time": finish_time,
                   "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
                   "finish_reason": None if finish_reason is None else str(getattr(finish_reason, "value",
                                                                                     finish_reason)),
                   "proposed": proposed, "accepted": accepted})

    def flush(self, timeout: float = 10.0) -> bool:
        """Write everything enqueued so far. True when it is on disk within ``timeout``."""
        if self._is_closed:
            return not self._thread.is_alive() and self._fatal is None
        return self._control("flush", timeout).ok

    def close(self, timeout: float = 10.0) -> None:
        """Flush and stop the writer thread (idempotent)."""
        if self._is_closed:
            return
        self._is_closed = True
        self._control("stop", timeout)
        self._thread.join(timeout)

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def run_id(self) -> int | None:
        return self._run_id

    @property
    def num_failures(self) -> int:
        return self._num_failures

    @property
    def num_dropped(self) -> int:
        return self._num_dropped

    @property
    def num_written_steps(self) -> int:
        return self._num_written_steps

    @property
    def last_error(self) -> str | None:
        return self._last_error

    def _put(self, item) -> None:
        if not self._run_started:
            raise RuntimeError("call LogWriter.start_run before writing steps or requests")
        if self._is_closed:
            self._drop()
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._drop()

    def _drop(self) -> None:
        with self._lock:
            self._num_dropped += 1
            first = self._num_dropped == 1
        if first:
            logger.warning("decision log %s: queue full or writer closed, dropping records (counted in "
                           "num_dropped; this is reported once)", self.path)

    def _control(self, kind: str, timeout: float, run_row: dict | None = None) -> _Control:
        ctl = _Control(kind, run_row)
        try:
            self._queue.put(ctl, timeout=timeout)
        except queue.Full:
            return ctl
        ctl.done.wait(timeout)
        return ctl

    # ---- writer thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        cfg = self.cfg
        while True:
            controls: list[_Control] = []
            deadline = time.monotonic() + cfg.flush_interval_s
            num_new = 0
            while num_new < cfg.batch_size and not controls:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
                if isinstance(item, _Control):
                    controls.append(item)
                else:
                    self._buffer(item)
                    num_new += 1
            for ctl in controls:
                if ctl.run_row is not None:
                    self._run_row = ctl.run_row
            ok = self._write() if (num_new or controls or self._has_pending) else True
            for ctl in controls:
                ctl.ok, ctl.error = ok, self._fatal
                if ctl.kind == "stop":
                    self._close_db()
                    ctl.done.set()
                    return
                ctl.done.set()

    @property
    def _has_pending(self) -> bool:
        return bool(self._run_row or self._steps or self._requests)

    def _buffer(self, item) -> None:
        if self._fatal is not None or len(self._steps) + len(self._requests) >= self.cfg.queue_max:
            self._drop()  # retry buffer full (writes failing for a long time) or the file is unusable
        elif isinstance(item, StepRecord):
            step, reqs = _step_rows(item)
            self._steps.append(step)
            self._step_requests.extend(reqs)
        else:
            self._requests.append(item)

    def _write(self) -> bool:
        if self._fatal is not None:
            return False
        try:
            db = self._open_db()
            run_id = self._run_id
            with db.atomic():
                if run_id is None:
                    db["runs"].insert(self._run_row)
                    run_id = db["runs"].last_pk
                for table, rows in (("steps", self._steps), ("step_requests", self._step_requests),
                                    ("requests", self._requests)):
                    if rows:
                        db[table].insert_all(({"run_id": run_id, **r} for r in rows), batch_size=1000)
        except Exception as e:  # noqa: BLE001 -- any write failure must leave serving alone
            self._fail(e)
            return False
        self._run_id, self._run_row = run_id, None
        self._num_written_steps += len(self._steps)
        self._steps, self._step_requests, self._requests = [], [], []
        if self._is_reported and self._last_error is not None:
            logger.warning("decision log %s: writes recovered after %d failed attempt(s)", self.path,
                           self._num_failures)
            self._last_error = None
        return True

    def _fail(self, e: Exception) -> None:
        self._num_failures += 1
        self._last_error = f"{type(e).__name__}: {e}"
        if isinstance(e, LogFormatError):
            self._fatal = e
            self._close_db()
            num_lost = len(self._steps) + len(self._requests)
            self._steps, self._step_requests, self._requests = [], [], []
            with self._lock:
                self._num_dropped += num_lost
        elif isinstance(e, sqlite3.Error):
            self._close_db()  # reopen on the next attempt (file may have been replaced, directory created)
        if not self._is_reported:
            self._is_reported = True
            logger.error("decision log %s: write failed (%s); serving continues, later flushes retry; "
                         "further failures are counted (num_failures), not logged", self.path, self._last_error)

    def _open_db(self) -> sqlite_utils.Database:
        if self._db is not None:
            return self._db
        conn = sqlite3.connect(self.path, timeout=self.cfg.busy_timeout_s)
        try:
            db = sqlite_utils.Database(conn)
            _check_schema(db, self.path, allow_new=True)
            db.enable_wal()
            db.execute("PRAGMA synchronous=NORMAL")
            with db.atomic():
                for name, columns in TABLES.items():
                    db[name].create(columns, pk="id" if name == "runs" else None, if_not_exists=True)
                for name, cols in INDEXES.items():
                    db[name].create_index(cols, if_not_exists=True)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        self._db = db
        return db

    def _close_db(self) -> None:
        if self._db is not None:
            try:
                self._db.close()
            except sqlite3.Error:
                pass
            self._db = None
