from __future__ import annotations

import json
import logging
import os
import random
import sqlite3
import threading
import time

import pytest
import sqlite_utils

from specsched.daemon.log import SCHEMA_VERSION, LogConfig, LogFormatError, LogWriter, open_log
from specsched.engine.records import StepRecord, StepRequestRecord
from specsched.engine.request import FinishReason

LOGGER = "specsched.daemon.log"


def make_record(step: int, rng: random.Random) -> StepRecord:
    reqs = []
    for j in range(rng.randint(1, 4)):
        k = rng.randint(0, 5)
        acc = rng.randint(0, k)
        bits = "1" * acc + ("0" if acc < k else "")
        reqs.append(
            StepRequestRecord(
                f"r{step}-{j}", context_len=rng.randint(1, 500), k=k, num_accepted=acc, match_bits=bits
            )
        )
    return StepRecord(
        step=step,
        kind="decode",
        start_time=time.time(),
        batch_size=len(reqs),
        num_tokens=sum(r.k + 1 for r in reqs),
        scorer=rng.choice(["batch_expansion", "mqa"]),
        policy="goodput",
        proposer="ngram",
        predicted_score_ms=rng.random(),
        score_ms=rng.random(),
        total_ms=2.0,
        num_emitted=sum(r.num_accepted + 1 for r in reqs),
        plan_info={"step": step, "why": "test"},
        requests=reqs,
    )


def fast_cfg(path, **kw) -> LogConfig:
    kw.setdefault("pace", "record")  # these tests drive the writer without an engine's nudges
    return LogConfig(path=str(path), flush_interval_s=kw.pop("flush_interval_s", 0.02), **kw)


def error_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.ERROR]


def test_steps_from_another_thread_all_present(tmp_path):
    path = tmp_path / "log.sqlite"
    rng = random.Random(0)
    records = [make_record(i, rng) for i in range(600)]
    w = LogWriter(fast_cfg(path, batch_size=64))
    config = {"model": {"source": "tiny"}, "policy": {"name": "goodput", "margin": 0.05}}
    run_id = w.start_run(config, model="tiny", device="cpu", version="0.1.0")
    assert run_id == 1

    def engine_thread():
        for r in records:
            w.write_step(r)

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    w.close()
    w.close()  # idempotent
    assert (w.num_written_steps, w.num_failures, w.num_dropped) == (600, 0, 0)

    db = open_log(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    (run,) = list(db["runs"].rows)
    assert json.loads(run["config"]) == config
    assert (run["model"], run["device"], run["version"], run["schema_version"]) == (
        "tiny",
        "cpu",
        "0.1.0",
        SCHEMA_VERSION,
    )
    rows = list(db.query("select * from steps order by step"))
    assert [r["step"] for r in rows] == list(range(600))
    assert {r["run_id"] for r in rows} == {run_id}
    assert [r["scorer"] for r in rows] == [r.scorer for r in records]
    assert json.loads(rows[7]["plan_info"]) == {"step": 7, "why": "test"}
    sums = db.execute("select count(*), sum(k), sum(num_accepted) from step_requests").fetchone()
    assert sums == (
        sum(len(r.requests) for r in records),
        sum(r.num_proposed for r in records),
        sum(r.num_accepted for r in records),
    )
    per_step = dict(db.execute("select step, sum(num_accepted) from step_requests group by step").fetchall())
    assert per_step == {r.step: r.num_accepted for r in records}
    bits = db.execute(
        "select match_bits from step_requests where request_id = ?", [records[5].requests[0].request_id]
    ).fetchone()[0]
    assert bits == records[5].requests[0].match_bits


def test_requests_and_flush(tmp_path):
    path = tmp_path / "log.sqlite"
    # durable=false: only explicit flushes write (durable would commit request rows at once)
    w = LogWriter(LogConfig(path=str(path), pace="record", flush_interval_s=30.0, durable=False))
    w.start_run({}, model="m", device="cpu", version="v")
    w.write_request(
        "a",
        client=b"\x00\xff",
        arrival=1.0,
        first_token_time=1.5,
        finish_time=2.0,
        prompt_tokens=5,
        output_tokens=7,
        finish_reason=FinishReason.LENGTH,
        proposed=9,
        accepted=4,
    )
    w.write_request(
        "b",
        client=None,
        arrival=1.0,
        first_token_time=None,
        finish_time=1.1,
        prompt_tokens=3,
        output_tokens=0,
        finish_reason="abort",
        proposed=0,
        accepted=0,
    )
    assert w.flush(timeout=10)
    db = open_log(path)
    rows = {r["request_id"]: r for r in db["requests"].rows}
    assert rows["a"]["client"] == "00ff" and rows["a"]["finish_reason"] == "length"
    assert (rows["a"]["output_tokens"], rows["a"]["accepted"], rows["a"]["run_id"]) == (7, 4, w.run_id)
    assert rows["b"]["first_token_time"] is None and rows["b"]["finish_reason"] == "abort"
    w.close()


def request_row(w: LogWriter, rid: str) -> int | None:
    return w.write_request(
        rid,
        client=b"\x01",
        arrival=1.0,
        first_token_time=1.1,
        finish_time=1.2,
        prompt_tokens=3,
        output_tokens=2,
        finish_reason="length",
        proposed=0,
        accepted=0,
    )


def wait_settled(w: LogWriter, seq: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while w.settled_seq < seq:
        assert time.monotonic() < deadline, f"record {seq} not settled (at {w.settled_seq})"
        time.sleep(0.002)


def count(path, table: str) -> int:
    db = sqlite3.connect(path)  # another connection: sees committed rows only
    try:
        return db.execute(f"select count(*) from {table}").fetchone()[0]
    finally:
        db.close()


def test_durable_request_row_commits_itself_and_the_steps_before_it(tmp_path):
    """A request row starts a commit within commit_interval_ms (not the 30 s flush interval), with
    the steps queued before it; the listener hears the settled sequence number."""
    path = tmp_path / "log.sqlite"
    w = LogWriter(LogConfig(path=str(path), pace="record", flush_interval_s=30.0))  # durable is the default
    assert w.is_durable
    w.start_run({}, model="m", device="cpu", version="v")
    heard: list[int] = []
    w.on_settled(heard.append)
    rng = random.Random(7)
    assert [w.write_step(make_record(i, rng)) for i in range(3)] == [1, 2, 3]
    time.sleep(0.2)
    assert w.settled_seq == 0 and heard == []  # steps alone wait for the flush interval
    t = time.monotonic()
    assert request_row(w, "a") == 4
    wait_settled(w, 4)
    assert time.monotonic() - t < 5.0
    assert heard == [4]
    assert (count(path, "requests"), count(path, "steps")) == (1, 3)
    w.close()


def test_durable_group_commit_batches_many_requests(tmp_path):
    """200 request rows enqueued at once settle in a few commits, not 200."""
    path = tmp_path / "log.sqlite"
    w = LogWriter(LogConfig(path=str(path), pace="record", flush_interval_s=30.0, commit_interval_ms=20.0))
    w.start_run({}, model="m", device="cpu", version="v")
    heard: list[int] = []
    w.on_settled(heard.append)
    seqs = [request_row(w, f"r{i}") for i in range(200)]
    assert seqs == list(range(1, 201))
    wait_settled(w, 200)
    assert heard == sorted(heard) and heard[-1] == 200
    assert len(heard) < 20, heard
    assert count(path, "requests") == 200
    w.close()


def test_durable_failed_write_still_settles_and_retries(tmp_path):
    """A locked database: the request is settled (its done may go: counted in num_failures) and its
    row is written once the lock is gone."""
    path = tmp_path / "log.sqlite"
    w = LogWriter(LogConfig(path=str(path), pace="record", flush_interval_s=0.05, busy_timeout_s=0.02))
    w.start_run({}, model="m", device="cpu", version="v")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    seq = request_row(w, "a")
    wait_settled(w, seq)
    assert w.num_failures >= 1
    other.execute("ROLLBACK")
    assert w.flush(timeout=5)
    assert count(path, "requests") == 1
    w.close()


def test_loose_mode_does_not_commit_before_the_flush_interval(tmp_path):
    path = tmp_path / "log.sqlite"
    w = LogWriter(LogConfig(path=str(path), pace="record", flush_interval_s=30.0, durable=False))
    w.start_run({}, model="m", device="cpu", version="v")
    assert request_row(w, "a") == 1
    time.sleep(0.2)
    assert w.settled_seq == 0 and count(path, "requests") == 0
    w.close()
    assert w.settled_seq == 1 and count(path, "requests") == 1


def test_restart_appends_a_run(tmp_path):
    path = tmp_path / "log.sqlite"
    rng = random.Random(1)
    for n in (3, 5):
        with LogWriter(fast_cfg(path)) as w:
            w.start_run({"n": n}, model="tiny", device="cpu", version="v")
            for i in range(n):
                w.write_step(make_record(i, rng))
    db = open_log(path)
    runs = list(db.query("select id, config from runs order by id"))
    assert [json.loads(r["config"])["n"] for r in runs] == [3, 5]
    counts = dict(db.execute("select run_id, count(*) from steps group by run_id").fetchall())
    assert counts == {runs[0]["id"]: 3, runs[1]["id"]: 5}
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_cost_models_are_saved_with_the_run_and_give_a_replay_its_graph_buckets(tmp_path):
    """save_costs writes a copy of the cost models under the run (start-up's, then replaced by the
    end's): the graph buckets a replay pads to, the coefficients, the per-graph residuals. Without them
    (the daemon's logs until 2026-12-04) a replay priced every scorer unpadded."""
    from specsched.policies.cost_model import CostModels
    from specsched.policies.replay_log import load_run

    path = tmp_path / "log.sqlite"
    rng = random.Random(3)
    costs = CostModels({"batch_expansion": [1, 2, 4, 8, 16]}, device="cuda")
    with LogWriter(fast_cfg(path)) as w:
        run_id = w.start_run({"n": 1}, model="tiny", device="cuda", version="v")
        assert w.save_costs(costs)
        records = [make_record(i, rng) for i in range(40)]
        for rec in records:
            w.write_step(rec)
            costs.observe(rec)  # the engine learns on; the saved copy does not move
        assert CostModels.load(str(path)).model("score", "batch_expansion").num_updates == 0
        assert w.save_costs(costs)
    loaded = CostModels.load(str(path), run_id=run_id)
    assert loaded.graph_buckets["batch_expansion"].tolist() == [1, 2, 4, 8, 16]
    num = costs.model("score", "batch_expansion").num_updates
    assert loaded.model("score", "batch_expansion").num_updates == num > 0
    assert loaded.biases["batch_expansion"].stats == costs.biases["batch_expansion"].stats
    assert load_run(str(path), run_id).settings.graph_buckets == {"batch_expansion": [1, 2, 4, 8, 16]}


def test_saving_cost_models_does_not_wait_for_the_flush_interval_when_paced(tmp_path):
    """``log.pace=step`` (the default): the writer sleeps until an engine nudge or the flush interval;
    a control must wake it. save_costs did not (the daemon's shutdown then waited 10 s, its timeout,
    with a 60 s flush interval, and reported the costs unsaved)."""
    from specsched.policies.cost_model import CostModels

    path = tmp_path / "log.sqlite"
    costs = CostModels({"batch_expansion": [1, 2, 4]}, device="cpu")
    with LogWriter(fast_cfg(path, pace="step", flush_interval_s=60.0)) as w:
        w.start_run({"n": 1}, model="tiny", device="cpu", version="v")
        t0 = time.monotonic()
        assert w.save_costs(costs, timeout=5.0)
        assert time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        assert w.end_run(0, timeout=5.0)
        assert time.monotonic() - t0 < 2.0
    assert CostModels.load(str(path)).graph_buckets["batch_expansion"].tolist() == [1, 2, 4]


def test_cost_models_that_cannot_be_saved_hold_no_step_back(tmp_path, caplog):
    class Broken:
        def save(self, db, run_id):
            raise ValueError("no JSON for this")

    path = tmp_path / "log.sqlite"
    rng = random.Random(4)
    with caplog.at_level(logging.WARNING, logger=LOGGER), LogWriter(fast_cfg(path)) as w:
        w.start_run({"n": 1}, model="tiny", device="cpu", version="v")
        w.save_costs(Broken())
        for i in range(5):
            w.write_step(make_record(i, rng))
    assert open_log(path).execute("select count(*) from steps").fetchone()[0] == 5
    said = [r.getMessage() for r in caplog.records]
    assert any("cost models were not saved (ValueError: no JSON for this)" in m for m in said), said


def test_locked_database_is_counted_logged_once_and_retried(tmp_path, caplog):
    path = tmp_path / "log.sqlite"
    rng = random.Random(2)
    w = LogWriter(fast_cfg(path, busy_timeout_s=0.02))
    assert w.start_run({}, model="m", device="cpu", version="v") is not None
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(50):
            w.write_step(make_record(i, rng))  # never raises, never blocks
        assert not w.flush(timeout=5)
        time.sleep(0.2)  # several more retries fail
        assert w.num_failures >= 2
        assert "locked" in w.last_error
        assert len(error_records(caplog)) == 1
        other.execute("ROLLBACK")
        assert w.flush(timeout=5)
    assert w.num_written_steps == 50 and w.num_dropped == 0
    w.close()
    assert len(error_records(caplog)) == 1
    assert open_log(path).execute("select count(*) from steps").fetchone()[0] == 50


@pytest.mark.parametrize("where", ["directory", "missing_parent"])
def test_unwritable_path_never_raises(tmp_path, caplog, where):
    path = tmp_path if where == "directory" else tmp_path / "no" / "such" / "log.sqlite"
    w = LogWriter(fast_cfg(path))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert w.start_run({}, model="m", device="cpu", version="v") is None
        rng = random.Random(3)
        for i in range(20):
            w.write_step(make_record(i, rng))
        w.write_request(
            "x",
            client=None,
            arrival=0.0,
            first_token_time=None,
            finish_time=0.0,
            prompt_tokens=1,
            output_tokens=0,
            finish_reason="abort",
            proposed=0,
            accepted=0,
        )
        assert not w.flush(timeout=5)
        w.close()
    assert w.num_failures > 0 and w.num_written_steps == 0
    assert w.num_dropped == 21  # what could never be written is counted at close
    assert len(error_records(caplog)) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_read_only_file_never_raises(tmp_path, caplog):
    path = tmp_path / "log.sqlite"
    with LogWriter(fast_cfg(path)) as w:
        w.start_run({}, model="m", device="cpu", version="v")
    os.chmod(path, 0o444)
    w = LogWriter(fast_cfg(path))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        w.start_run({}, model="m", device="cpu", version="v")
        w.write_step(make_record(0, random.Random(4)))
        w.close()
    assert w.num_failures > 0 and len(error_records(caplog)) == 1


def test_full_queue_drops_and_counts(tmp_path):
    path = tmp_path / "log.sqlite"
    rng = random.Random(5)
    # busy_timeout_s far beyond the test: the writer stays blocked until the ROLLBACK below
    w = LogWriter(fast_cfg(path, batch_size=4, queue_max=8, busy_timeout_s=10.0))
    w.start_run({}, model="m", device="cpu", version="v")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    w.write_step(make_record(0, rng))
    deadline = time.monotonic() + 10.0
    while w._queue.qsize() and time.monotonic() < deadline:  # the writer took record 0 ...
        time.sleep(0.01)
    time.sleep(0.2)  # ... and is blocked in its write (a loaded CI machine may be slow to get there)
    t0 = time.perf_counter()
    for i in range(1, 40):
        w.write_step(make_record(i, rng))
    assert time.perf_counter() - t0 < 0.5  # the engine side never waited for the disk
    assert w.num_dropped >= 39 - 8
    other.execute("ROLLBACK")
    w.close()
    assert w.num_written_steps + w.num_dropped == 40
    assert open_log(path).execute("select count(*) from steps").fetchone()[0] == w.num_written_steps


def test_write_before_start_run_and_after_close(tmp_path):
    w = LogWriter(fast_cfg(tmp_path / "log.sqlite"))
    with pytest.raises(RuntimeError, match="start_run"):
        w.write_step(make_record(0, random.Random(6)))
    w.start_run({}, model="m", device="cpu", version="v")
    with pytest.raises(RuntimeError, match="already"):
        w.start_run({}, model="m", device="cpu", version="v")
    w.close()
    w.write_step(make_record(0, random.Random(6)))  # after close: dropped, not raised
    assert w.num_dropped == 1


def test_open_log_rejects_other_schema_version(tmp_path):
    path = tmp_path / "log.sqlite"
    with LogWriter(fast_cfg(path)) as w:
        w.start_run({}, model="m", device="cpu", version="v")
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(LogFormatError, match=f"schema version {SCHEMA_VERSION + 1}"):
        open_log(path)
    w = LogWriter(fast_cfg(path))  # the writer refuses to append to it, loudly
    with pytest.raises(LogFormatError, match="schema version"):
        w.start_run({}, model="m", device="cpu", version="v")
    w.close()


def test_open_log_rejects_garbage_and_foreign_files(tmp_path):
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(random.Random(7).randbytes(8192))
    with pytest.raises(LogFormatError, match="not a readable SQLite file"):
        open_log(garbage)
    with pytest.raises(LogFormatError, match="no such log file"):
        open_log(tmp_path / "missing.sqlite")
    foreign = tmp_path / "foreign.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("create table t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(LogFormatError, match="not a specsched log"):
        open_log(foreign)
    w = LogWriter(fast_cfg(garbage))
    with pytest.raises(LogFormatError):
        w.start_run({}, model="m", device="cpu", version="v")
    w.close()


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"path": ""}, "log.path"),
        ({"flush_interval_s": 0}, "flush_interval_s"),
        ({"batch_size": 0}, "batch_size"),
        ({"queue_max": 10, "batch_size": 20}, "queue_max"),
        ({"busy_timeout_s": -1}, "busy_timeout_s"),
        ({"commit_interval_ms": -1}, "commit_interval_ms"),
        ({"durable": "yes"}, "durable"),
    ],
)
def test_log_config_validation(kw, name):
    with pytest.raises(ValueError, match=name):
        LogConfig(**kw)


def test_writer_needs_a_path():
    with pytest.raises(ValueError, match="log.path"):
        LogWriter(LogConfig(path=None))


def test_end_run_closes_the_run_row_with_the_compiles_after_start(tmp_path):
    path = str(tmp_path / "end.sqlite")
    w = LogWriter(fast_cfg(path))
    w.start_run({}, model="tiny", device="cpu", version="t")
    t0 = time.time()
    assert w.end_run(num_compiles_after_start=3)
    w.close()
    assert not w.end_run(num_compiles_after_start=9)  # closed: refused at once, nothing written
    (run,) = list(open_log(path)["runs"].rows)
    assert run["num_compiles_after_start"] == 3 and t0 <= run["ended_at"] <= time.time()


def test_a_version_1_log_is_read_and_migrated_when_appended_to(tmp_path):
    path = str(tmp_path / "v1.sqlite")
    db = sqlite_utils.Database(path)  # the version 1 schema, as an older specsched wrote it
    db.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, started_at REAL, config TEXT, model TEXT, "
               "device TEXT, version TEXT, schema_version INTEGER)")  # fmt: skip
    db.execute("INSERT INTO runs (started_at, config, schema_version) VALUES (1.0, '{}', 1)")
    db.execute("PRAGMA user_version = 1")
    db.conn.commit()
    db.close()
    assert open_log(path)["runs"].count == 1  # readable as it is
    w = LogWriter(fast_cfg(path))
    assert w.start_run({}, model="tiny", device="cpu", version="t") == 2
    w.end_run(num_compiles_after_start=0)
    w.close()
    db = open_log(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    rows = list(db.query("select id, schema_version, num_compiles_after_start from runs order by id"))
    assert rows == [
        {"id": 1, "schema_version": 1, "num_compiles_after_start": None},
        {"id": 2, "schema_version": SCHEMA_VERSION, "num_compiles_after_start": 0},
    ]
