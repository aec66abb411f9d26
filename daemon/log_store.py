"""The writer thread's side of the decision log: rows waiting for a successful write, the SQLite
connection, and what a failed write does (counted, reported once, retried by the next flush).

Only the writer thread (log.py: :class:`LogWriter`) calls a :class:`LogStore`; the serving threads read
its counters.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Sequence
from itertools import chain
from typing import TYPE_CHECKING

from specsched.daemon.log_config import LogConfig
from specsched.engine.log_schema import (
    SCHEMA_SQL,
    SCHEMA_VERSION,
    STEP_REQUEST_COLUMNS,
    LogFormatError,
    check_schema,
    migrate,
    step_rows,
)
from specsched.engine.records import StepRecord

if TYPE_CHECKING:  # imported by the writer thread when it opens the file (_open_db): not at start-up
    import sqlite_utils

logger = logging.getLogger("specsched.daemon.log")  # one logger name for the whole decision log


MAX_PARAMS = 999  # parameters of one statement: SQLite's lowest default limit (before 3.32)


def _insert(
    db: sqlite_utils.Database, table: str, run_id: int, rows: list, cols: Sequence[str] | None = None
) -> None:
    """Insert ``rows`` (dicts that share their keys, our own column names; or tuples in the order of
    ``cols``) with multi-row INSERTs, each one ``sqlite3_step``: the sqlite3 module lets go of the GIL
    once per step, and each time the engine thread may keep it for a switch interval (5 ms), so a
    write of 50 rows one by one (``insert_all``, ``executemany``) can take tens of ms under load,
    while a durable ``done`` waits for it."""
    is_tuples = cols is not None
    cols = list(cols if is_tuples else rows[0])
    one = "(" + ", ".join([str(int(run_id))] + ["?"] * len(cols)) + ")"
    head = f"INSERT INTO {table} (run_id, {', '.join(cols)}) VALUES "
    per_insert = max(1, MAX_PARAMS // len(cols))
    for i in range(0, len(rows), per_insert):
        chunk = rows[i : i + per_insert]
        params = list(chain.from_iterable(chunk)) if is_tuples else [r[c] for r in chunk for c in cols]
        db.conn.execute(head + ", ".join([one] * len(chunk)), params)


class LogStore:
    """Buffers rows and writes them in one transaction per :meth:`write`. ``drop(n, quiet)`` counts
    records that will never be written (the writer's ``num_dropped``)."""

    def __init__(self, path: str, cfg: LogConfig, drop: Callable[..., None]) -> None:
        self.path, self.cfg, self._drop = path, cfg, drop
        self.run_id: int | None = None
        self.run_row: dict | None = None  # until written
        self.run_end: dict | None = None  # the run row's closing fields, until written
        self.costs = None  # cost models to save (CostModels: .save(db, run_id)), until written
        self.fatal: LogFormatError | None = None
        self.num_failures = 0
        self.num_written_steps = 0
        self.last_error: str | None = None
        self._is_reported = False
        self._is_failing = False
        self._db: sqlite_utils.Database | None = None
        # rows awaiting a successful write (run_id stamped at write time)
        self._steps: list[dict] = []
        self._step_requests: list[tuple] = []  # STEP_REQUEST_COLUMNS order
        self._requests: list[dict] = []

    @property
    def has_pending(self) -> bool:
        return bool(self.run_row or self.run_end or self.costs or self._steps or self._requests)

    @property
    def has_requests(self) -> bool:
        """A ``requests`` row is buffered (with ``log.durable`` its done waits for the commit)."""
        return bool(self._requests)

    @property
    def num_pending(self) -> int:
        """Records held for the next write (read from the serving threads too: a bound, not exact)."""
        return len(self._steps) + len(self._requests)

    def buffer(self, item: StepRecord | dict) -> None:
        """Hold a step record (-> ``steps`` + ``step_requests`` rows) or a ``requests`` row."""
        if self.fatal is not None or self.num_pending >= self.cfg.queue_max:
            self._drop()  # retry buffer full (writes failing for a long time) or the file is unusable
        elif isinstance(item, StepRecord):
            try:
                step, reqs = step_rows(item)
            except Exception as e:  # noqa: BLE001 -- a malformed record must not poison the batch
                self._fail(e)
                self._drop()
                return
            self._steps.append(step)
            self._step_requests.extend(reqs)
        else:
            self._requests.append(item)

    def write(self) -> bool:
        """Write the run row (once) and everything buffered; False when it could not (rows are kept)."""
        if self.fatal is not None:
            return False
        if self.run_id is None and self.run_row is None:
            return True  # nothing to write before start_run
        try:
            db = self._open_db()
            run_id = self.run_id
            with db.atomic():
                if run_id is None:
                    run_id = db["runs"].insert(self.run_row).last_pk
                for table, rows, cols in (
                    ("steps", self._steps, None),
                    ("step_requests", self._step_requests, STEP_REQUEST_COLUMNS),
                    ("requests", self._requests, None),
                ):
                    if rows:
                        _insert(db, table, run_id, rows, cols)
                if self.run_end:
                    sets = ", ".join(f"{k} = ?" for k in self.run_end)
                    db.execute(f"UPDATE runs SET {sets} WHERE id = ?", [*self.run_end.values(), run_id])
        except Exception as e:  # noqa: BLE001 -- any write failure must leave serving alone
            self._fail(e)
            return False
        self.run_id, self.run_row, self.run_end = run_id, None, None
        if self.costs is not None:  # apart, and tried once: cost models that cannot be saved must not
            costs, self.costs = self.costs, None  # hold the step rows back
            try:
                costs.save(db, run_id)
            except Exception as e:  # noqa: BLE001
                logger.warning("decision log %s: the cost models were not saved (%s: %s)", self.path,
                               type(e).__name__, e)  # fmt: skip
        self.num_written_steps += len(self._steps)
        self._steps, self._step_requests, self._requests = [], [], []
        if self._is_failing:
            self._is_failing = False
            logger.warning(
                "decision log %s: writes recovered (%d failed attempt(s) so far)",
                self.path,
                self.num_failures,
            )
        return True

    def discard_pending(self) -> None:
        """Count what is buffered as dropped and forget it."""
        self._drop(len(self._steps) + len(self._requests), quiet=True)
        self._steps, self._step_requests, self._requests = [], [], []

    def close(self) -> None:
        if self._db is not None:
            try:
                self._db.close()
            except sqlite3.Error:
                pass
            self._db = None

    def _fail(self, e: Exception) -> None:
        self.num_failures += 1
        self._is_failing = True
        self.last_error = f"{type(e).__name__}: {e}"
        if isinstance(e, LogFormatError):  # the file is not ours: give up on it (start_run raises it)
            self.fatal = e
            self.close()
            self.discard_pending()
            logger.error("decision log %s is unusable (%s); no records will be written", self.path, e)
            return
        if isinstance(e, sqlite3.Error):
            self.close()  # reopen on the next attempt (file may have been replaced, directory created)
        if not self._is_reported:
            self._is_reported = True
            logger.error(
                "decision log %s: write failed (%s); serving continues, later flushes retry; "
                "further failures are counted (num_failures), not logged",
                self.path,
                self.last_error,
            )

    def _open_db(self) -> sqlite_utils.Database:
        if self._db is not None:
            return self._db
        import sqlite_utils  # ~0.1-0.7 s (it scans every package's entry points); cli.py imports it ahead

        conn = sqlite3.connect(self.path, timeout=self.cfg.busy_timeout_s)
        try:
            db = sqlite_utils.Database(conn)
            check_schema(db, self.path, allow_new=True)
            db.enable_wal()
            db.execute("PRAGMA synchronous=NORMAL")
            with db.atomic():
                migrate(db)  # a file an older specsched wrote: add what this version's rows have
                for statement in SCHEMA_SQL.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        self._db = db
        return db
