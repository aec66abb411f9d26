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

# Times are time.time() seconds (unix epoch); durations are milliseconds. See docs/logging.md.
SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY, started_at REAL, config TEXT, model TEXT,
    device TEXT, version TEXT, schema_version INTEGER);
CREATE TABLE IF NOT EXISTS requests (run_id INTEGER, request_id TEXT, client TEXT, arrival REAL,
    first_token_time REAL, finish_time REAL, prompt_tokens INTEGER, output_tokens INTEGER,
    finish_reason TEXT, proposed INTEGER, accepted INTEGER);
CREATE TABLE IF NOT EXISTS steps (run_id INTEGER, step INTEGER, kind TEXT, start_time REAL,
    batch_size INTEGER, num_tokens INTEGER, scorer TEXT, policy TEXT, proposer TEXT, is_synthetic INTEGER,
    predicted_propose_ms REAL, predicted_score_ms REAL, predicted_verify_ms REAL, predicted_ms REAL,
    propose_ms REAL, score_ms REAL, verify_ms REAL, total_ms REAL, num_emitted INTEGER, plan_info TEXT);
CREATE TABLE IF NOT EXISTS step_requests (run_id INTEGER, step INTEGER, request_id TEXT,
    context_len INTEGER, k INTEGER, num_accepted INTEGER, match_bits TEXT, num_emitted INTEGER);
CREATE INDEX IF NOT EXISTS requests_run_request ON requests (run_id, request_id);
CREATE INDEX IF NOT EXISTS steps_run_step ON steps (run_id, step);
CREATE INDEX IF NOT EXISTS step_requests_run_step ON step_requests (run_id, step);
"""
# StepRecord / StepRequestRecord fields copied as they are (plan_info is converted to JSON)
STEP_FIELDS = (
    "step kind start_time batch_size num_tokens scorer policy proposer is_synthetic predicted_propose_ms "
    "predicted_score_ms predicted_verify_ms predicted_ms propose_ms score_ms verify_ms total_ms num_emitted"
).split()
STEP_REQUEST_FIELDS = ("request_id", "context_len", "k", "num_accepted", "match_bits", "num_emitted")


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
            raise ValueError(
                f"log.queue_max must be >= log.batch_size ({self.batch_size}), got {self.queue_max}"
            )
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
    if version == SCHEMA_VERSION:
        if "runs" in tables:
            return
        raise LogFormatError(f"{path}: damaged specsched log (schema version {version} but no runs table)")
    if version == 0 and not tables and allow_new:
        return
    if version == 0:
        raise LogFormatError(f"{path}: not a specsched log (no schema version; tables: {sorted(tables)})")
    raise LogFormatError(
        f"{path}: log schema version {version} (another specsched version wrote it); "
        f"this specsched reads version {SCHEMA_VERSION}"
    )


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
    def default(x):  # numpy / torch scalars, enums, anything else as its str
        try:
            return x.item()
        except Exception:  # noqa: BLE001
            return str(x)

    return json.dumps(obj, default=default)


def _step_rows(r: StepRecord) -> tuple[dict, list[dict]]:
    step = {f: getattr(r, f) for f in STEP_FIELDS}
    step["plan_info"] = _json(r.plan_info) if r.plan_info else None
    reqs = [{"step": r.step, **{f: getattr(q, f) for f in STEP_REQUEST_FIELDS}} for q in r.requests]
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
        self._is_failing = False
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
            "config": _json(config),
            "model": model,
            "device": device,
            "version": version,
            "schema_version": SCHEMA_VERSION,
        }
        ctl = self._control("run", timeout, run_row=row)
        if isinstance(ctl.error, LogFormatError):
            raise ctl.error
        return self._run_id

    def write_step(self, record: StepRecord) -> None:
        """Enqueue one step (→ ``steps`` + ``step_requests``). The record must not be mutated afterwards."""
        self._put(record)

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
    ) -> None:
        """Enqueue one finished request (→ ``requests``). Times are ``time.time()`` seconds."""
        self._put(
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
            }
        )

    def flush(self, timeout: float = 10.0) -> bool:
        """Write everything enqueued so far. True when it is on disk within ``timeout``."""
        if self._is_closed:
            return self._fatal is None and not self._has_pending
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
            logger.warning(
                "decision log %s: dropping records (queue or retry buffer full, or writer closed); "
                "counted in num_dropped, reported once",
                self.path,
            )

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
                    self._discard_pending()  # what the last write could not store is lost: count it
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
            try:
                step, reqs = _step_rows(item)
            except Exception as e:  # noqa: BLE001 -- a malformed record must not poison the batch
                self._fail(e)
                self._drop()
                return
            self._steps.append(step)
            self._step_requests.extend(reqs)
        else:
            self._requests.append(item)

    def _write(self) -> bool:
        if self._fatal is not None:
            return False
        if self._run_id is None and self._run_row is None:
            return True  # nothing to write before start_run
        try:
            db = self._open_db()
            run_id = self._run_id
            with db.atomic():
                if run_id is None:
                    run_id = db["runs"].insert(self._run_row).last_pk
                for table, rows in (
                    ("steps", self._steps),
                    ("step_requests", self._step_requests),
                    ("requests", self._requests),
                ):
                    if rows:
                        db[table].insert_all(({"run_id": run_id, **r} for r in rows), batch_size=1000)
        except Exception as e:  # noqa: BLE001 -- any write failure must leave serving alone
            self._fail(e)
            return False
        self._run_id, self._run_row = run_id, None
        self._num_written_steps += len(self._steps)
        self._steps, self._step_requests, self._requests = [], [], []
        if self._is_failing:
            self._is_failing = False
            logger.warning(
                "decision log %s: writes recovered (%d failed attempt(s) so far)",
                self.path,
                self._num_failures,
            )
        return True

    def _fail(self, e: Exception) -> None:
        self._num_failures += 1
        self._is_failing = True
        self._last_error = f"{type(e).__name__}: {e}"
        if isinstance(e, LogFormatError):  # the file is not ours: give up on it (start_run raises it)
            self._fatal = e
            self._close_db()
            self._discard_pending()
            logger.error("decision log %s is unusable (%s); no records will be written", self.path, e)
            return
        if isinstance(e, sqlite3.Error):
            self._close_db()  # reopen on the next attempt (file may have been replaced, directory created)
        if not self._is_reported:
            self._is_reported = True
            logger.error(
                "decision log %s: write failed (%s); serving continues, later flushes retry; "
                "further failures are counted (num_failures), not logged",
                self.path,
                self._last_error,
            )

    def _discard_pending(self) -> None:
        with self._lock:
            self._num_dropped += len(self._steps) + len(self._requests)
        self._steps, self._step_requests, self._requests = [], [], []

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
                for statement in SCHEMA_SQL.split(";"):
                    if statement.strip():
                        db.execute(statement)
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
