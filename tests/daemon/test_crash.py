"""Crash safety of the decision log: ``kill -9`` mid-run (integrity; every request that reached
``done`` is there with ``log.durable``, the default, and all but those of the last flush interval with
``log.durable=false``; a restart appends a run; tests/daemon/test_durable.py has the 300-request
burst), and a log that cannot be written (disk full, via a file-size limit on the daemon process; an
unopenable path): serving goes on, the failure is counted in ``stats`` and logged once, and once
writing works again nothing is missing."""

from __future__ import annotations

import asyncio
import resource
import shutil
import sqlite3
import time

import pytest

from specsched.client.sync_client import AsyncClient, Client

pytestmark = pytest.mark.slow
FLUSH_INTERVAL_S = 0.5  # log.flush_interval_s: the production default (conf/log/default.yaml)
SLACK_S = 1.0  # scheduling slack on 2 busy cores, on top of the flush interval


def integrity(path) -> str:
    db = sqlite3.connect(path)
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        db.close()


def query(path, sql: str, *args) -> list[tuple]:
    db = sqlite3.connect(path)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


async def traffic(endpoint: str, num_clients: int, stop_at: float, done_at: dict[str, float]) -> None:
    """Short requests in a loop from each client until ``stop_at``; record when each got its done."""

    async def one(k: int) -> None:
        async with AsyncClient(endpoint, timeout_s=30) as c:
            j = 0
            while time.time() < stop_at:
                rid = f"c{k}-{j}"
                try:
                    r = await c.generate(prompt_ids=[3 + k, 4, 5, 3 + k, 4], max_tokens=4 + j % 4, id=rid)
                except Exception:  # noqa: BLE001 -- the daemon is killed under us: expected
                    return
                done_at[r.id] = time.time()
                j += 1

    await asyncio.gather(*(one(k) for k in range(num_clients)))


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "loose"])
def test_kill_9_mid_run_keeps_what_was_done_and_restart_appends(start_daemon, tmp_path, durable):
    """durable: nothing that got its done is missing; durable=false: at most the last flush interval."""
    log_path = tmp_path / "crash.sqlite"
    log = {"flush_interval_s": FLUSH_INTERVAL_S, "durable": durable}
    d = start_daemon(log_path=log_path, log=log)
    done_at: dict[str, float] = {}
    kill_at = time.time() + 2.5

    async def run():
        load = asyncio.create_task(traffic(d.endpoint, 8, kill_at + 5, done_at))
        await asyncio.sleep(kill_at - time.time())
        d.proc.kill()  # SIGKILL mid-run: no handler, no flush
        t = time.time()
        await load
        return t

    killed_at = asyncio.run(run())
    assert d.proc.wait(10) == -9
    assert len(done_at) > 100, "the run was too short to mean anything"

    assert integrity(log_path) == "ok"
    logged = {rid.split(":", 1)[1] for (rid,) in query(log_path, "SELECT request_id FROM requests")}
    missing = {rid: killed_at - t for rid, t in done_at.items() if rid not in logged}
    must_have = {rid for rid, t in done_at.items() if t < killed_at - FLUSH_INTERVAL_S - SLACK_S}
    assert not (must_have - logged), f"done > {FLUSH_INTERVAL_S + SLACK_S} s before the kill, not logged"
    if durable:
        assert not missing, f"{len(missing)} requests got their done but are not in the log"
    print(
        f"\nkill -9 (durable={durable}): {len(done_at)} requests done, {len(missing)} not in the log "
        f"(all done within {max(missing.values(), default=0):.3f} s of the kill)"
    )
    (steps,) = query(log_path, "SELECT COUNT(*) FROM steps")[0]
    assert steps > 0

    again = start_daemon(log_path=log_path, log=log)
    with Client(again.endpoint, timeout_s=30) as c:
        r = c.generate(prompt_ids=[1, 2, 3], max_tokens=3, id="after-restart")
    assert again.stop() == 0
    assert integrity(log_path) == "ok"
    assert [row[0] for row in query(log_path, "SELECT id FROM runs ORDER BY id")] == [1, 2]
    rows = query(log_path, "SELECT run_id, request_id, output_tokens FROM requests WHERE run_id = 2")
    assert [(run, rid.split(":", 1)[1], n) for run, rid, n in rows] == [(2, r.id, 3)]
    run1 = query(log_path, "SELECT request_id FROM requests WHERE run_id = 1")
    assert {rid.split(":", 1)[1] for (rid,) in run1} == logged  # run 1 untouched


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    """Poll ``predicate`` until truthy (a database the writer is still creating reads as not yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except sqlite3.OperationalError:  # no such table (yet)
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_disk_full_log_keeps_serving_counts_once_and_recovers(start_daemon, tmp_path):
    """A file-size limit (``prlimit --fsize``) on the running daemon makes every write that grows the
    log fail (EFBIG, as on a full disk)."""
    log_path = tmp_path / "full.sqlite"
    d = start_daemon(log_path=log_path, log={"flush_interval_s": 0.1})
    with Client(d.endpoint, timeout_s=30) as c:
        c.generate(prompt_ids=[1, 2, 3], max_tokens=3)
        wait_for(lambda: query(log_path, "SELECT COUNT(*) FROM requests")[0][0] == 1, what="the first row")
        files = [log_path, log_path.with_name(log_path.name + "-wal"), d.output_path]
        limit = max(p.stat().st_size for p in files if p.exists())
        _, hard = resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE, (limit, hard))
        served = [c.generate(prompt_ids=[4, 5, 6], max_tokens=16).id for _ in range(80)]
        stats = wait_for(lambda: (s := c.stats()).num_log_failures >= 3 and s, what="log failures")
        assert stats.num_requests_done == 81 and stats.num_log_dropped == 0
        served += [c.generate(prompt_ids=[4, 5, 6], max_tokens=16).id for _ in range(20)]
        assert c.stats().num_log_failures >= stats.num_log_failures
        # held back (a failed writer reopens the file, and a checkpoint may free a little room first,
        # but far less than this traffic needs)
        held = query(log_path, "SELECT COUNT(*) FROM requests")[0][0]
        assert held < 101, held
        print(f"\ndisk full: {c.stats().num_log_failures} failed writes; {101 - held} of 101 rows held back")

        resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, hard))  # space again
        rows = wait_for(
            lambda: (r := query(log_path, "SELECT request_id FROM requests")) and len(r) == 101 and r,
            what="the rows written while the disk was full",
        )
        assert {rid.split(":", 1)[1] for (rid,) in rows} >= set(served)
    assert d.stop() == 0
    out = d.output()
    assert out.count("write failed") == 1, out  # logged once, not per step or per flush
    assert "writes recovered" in out
    assert integrity(log_path) == "ok"


def test_unusable_log_path_keeps_serving_and_recovers_when_it_is_fixed(start_daemon, tmp_path):
    """The log's path is a directory (cannot be opened as a file, even by root): start and serve
    anyway; once the directory is gone the writer creates the file and writes everything."""
    log_path = tmp_path / "blocked.sqlite"
    log_path.mkdir()
    (log_path / "placeholder").write_text("x")
    d = start_daemon(log_path=log_path, log={"flush_interval_s": 0.1})
    with Client(d.endpoint, timeout_s=30) as c:
        ids = [c.generate(prompt_ids=[7, 8, 9], max_tokens=4).id for _ in range(5)]
        stats = wait_for(lambda: (s := c.stats()).num_log_failures > 0 and s, what="a log failure")
        assert stats.num_requests_done == 5
        shutil.rmtree(log_path)
        rows = wait_for(
            lambda: log_path.is_file() and (r := query(log_path, "SELECT request_id FROM requests")) and r,
            what="the rows after the path was fixed",
        )
        assert {rid.split(":", 1)[1] for (rid,) in rows} == set(ids)
    assert d.stop() == 0
    out = d.output()
    assert out.count("write failed") == 1 and "writes recovered" in out, out
    assert [r[0] for r in query(log_path, "SELECT id FROM runs")] == [1]
