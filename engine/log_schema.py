"""The decision log's schema and its readers: the tables (``SCHEMA_SQL``, version ``SCHEMA_VERSION``),
how a step record becomes rows, and :func:`open_log` for replay and analysis. The one place both the
service's writer (daemon/log.py) and the offline replay (policies/replay_log.py) take them from.

Times are time.time() seconds (unix epoch); durations are milliseconds. See docs/logging.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
from array import array
from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

from specsched.engine.records import StepRecord

if TYPE_CHECKING:  # imported by open_log: a daemon without a log does not pay its import
    import sqlite_utils

SCHEMA_VERSION = 4  # bump on any change to the tables below (with a MIGRATIONS entry)
READABLE_VERSIONS = (1, 2, 3, 4)  # readers take these; the writer migrates an older file when it appends
MIGRATIONS = {  # version -> the statements that take a file from it to the next version
    1: [
        "ALTER TABLE runs ADD COLUMN ended_at REAL",
        "ALTER TABLE runs ADD COLUMN num_compiles_after_start INTEGER",
    ],
    2: [
        "ALTER TABLE steps ADD COLUMN host_ms TEXT",
        "ALTER TABLE step_requests ADD COLUMN max_k INTEGER",
    ],
    3: ["ALTER TABLE requests ADD COLUMN prompt_hash TEXT"],
}  # an ALTER of a table the file lacks is skipped: the CREATE below makes it with every column

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY, started_at REAL, config TEXT, model TEXT,
    device TEXT, version TEXT, schema_version INTEGER, ended_at REAL, num_compiles_after_start INTEGER);
CREATE TABLE IF NOT EXISTS requests (run_id INTEGER, request_id TEXT, client TEXT, arrival REAL,
    first_token_time REAL, finish_time REAL, prompt_tokens INTEGER, output_tokens INTEGER,
    finish_reason TEXT, proposed INTEGER, accepted INTEGER, prompt_hash TEXT);
CREATE TABLE IF NOT EXISTS steps (run_id INTEGER, step INTEGER, kind TEXT, start_time REAL,
    batch_size INTEGER, num_tokens INTEGER, scorer TEXT, policy TEXT, proposer TEXT, is_synthetic INTEGER,
    predicted_propose_ms REAL, predicted_score_ms REAL, predicted_verify_ms REAL, predicted_ms REAL,
    propose_ms REAL, score_ms REAL, verify_ms REAL, total_ms REAL, num_emitted INTEGER, plan_info TEXT,
    host_ms TEXT);
CREATE TABLE IF NOT EXISTS step_requests (run_id INTEGER, step INTEGER, request_id TEXT,
    context_len INTEGER, k INTEGER, num_accepted INTEGER, match_bits TEXT, num_emitted INTEGER,
    max_k INTEGER);
CREATE INDEX IF NOT EXISTS requests_run_request ON requests (run_id, request_id);
CREATE INDEX IF NOT EXISTS steps_run_step ON steps (run_id, step);
CREATE INDEX IF NOT EXISTS step_requests_run_step ON step_requests (run_id, step);
"""
# StepRecord / StepRequestRecord fields copied as they are (plan_info and host_ms are converted to JSON)
STEP_FIELDS = (
    "step kind start_time batch_size num_tokens scorer policy proposer is_synthetic predicted_propose_ms "
    "predicted_score_ms predicted_verify_ms predicted_ms propose_ms score_ms verify_ms total_ms num_emitted"
).split()
STEP_REQUEST_FIELDS = ("request_id", "context_len", "k", "num_accepted", "match_bits", "num_emitted", "max_k")
STEP_REQUEST_COLUMNS = ("step", *STEP_REQUEST_FIELDS)  # step_rows' request tuples
_request_row = attrgetter(*STEP_REQUEST_FIELDS)


class LogFormatError(Exception):
    """The file is not a specsched log of this schema version (or not SQLite at all)."""


def check_schema(db: sqlite_utils.Database, path: str, allow_new: bool) -> None:
    """Raise :class:`LogFormatError` unless ``db`` is a specsched log of a version in
    :data:`READABLE_VERSIONS` (or, with ``allow_new``, an empty database)."""
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = set(db.table_names())
    except sqlite3.OperationalError:
        raise
    except sqlite3.DatabaseError as e:  # "file is not a database", "malformed"
        raise LogFormatError(f"{path}: not a readable SQLite file ({e})") from e
    if version in READABLE_VERSIONS:
        if "runs" in tables:
            return
        raise LogFormatError(f"{path}: damaged specsched log (schema version {version} but no runs table)")
    if version == 0 and not tables and allow_new:
        return
    if version == 0:
        raise LogFormatError(f"{path}: not a specsched log (no schema version; tables: {sorted(tables)})")
    raise LogFormatError(
        f"{path}: log schema version {version} (another specsched version wrote it); "
        f"this specsched reads versions {', '.join(map(str, READABLE_VERSIONS))}"
    )


def migrate(db: sqlite_utils.Database) -> None:
    """Bring a log of an older readable version up to :data:`SCHEMA_VERSION` (in the caller's
    transaction); a new or current file is left as it is."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version == 0 or "runs" not in set(db.table_names()):
        return
    tables = set(db.table_names())
    while version < SCHEMA_VERSION:
        for statement in MIGRATIONS[version]:
            if statement.startswith("ALTER TABLE ") and statement.split()[2] not in tables:
                continue
            db.execute(statement)
        version += 1


def open_log(path: str | os.PathLike) -> sqlite_utils.Database:
    """Open an existing log for reading (replay, analysis); checks it is a log of this schema version."""
    import sqlite_utils

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LogFormatError(f"{path}: no such log file")
    try:
        db = sqlite_utils.Database(path)
        check_schema(db, path, allow_new=False)
    except sqlite3.Error as e:
        raise LogFormatError(f"{path}: cannot read log ({e})") from e
    return db


def prompt_hash(token_ids: Sequence[int]) -> str:
    """The ``requests.prompt_hash`` of a prompt: 16 hex digits of BLAKE2b over its token ids (int64,
    little-endian). Lives of one prompt share it, so the replay can pool their match bits
    (policies/replay_log.py) without the log keeping the prompt's text."""
    ids = array("q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=8).hexdigest()


def to_json(obj) -> str:
    def default(x):  # numpy / torch scalars, enums, anything else as its str
        try:
            return x.item()
        except Exception:  # noqa: BLE001
            return str(x)

    return json.dumps(obj, default=default)


def step_rows(r: StepRecord) -> tuple[dict, list[tuple]]:
    """The ``steps`` row of a record (a dict) and its ``step_requests`` rows, tuples in the order of
    :data:`STEP_REQUEST_COLUMNS`: the log's writer thread builds them holding the interpreter lock,
    64 a step at batch 64 (dicts took ~150 us a step on the dev CPU, tuples ~30)."""
    step = {f: getattr(r, f) for f in STEP_FIELDS}
    step["plan_info"] = to_json(r.plan_info) if r.plan_info else None
    step["host_ms"] = to_json({k: round(v, 4) for k, v in r.host_ms.items()}) if r.host_ms else None
    num, row = r.step, _request_row
    return step, [(num, *row(q)) for q in r.requests]
