"""Durable completions (issue 15): with ``log.durable`` (the default) a ``done`` leaves only once the
request's row and its steps are committed, so a client told "done" finds its request in the log after
a ``kill -9``; ``log.durable=false`` keeps the old mode (``done`` at once, rows within the flush
interval). Real daemons on loopback, real SQLite files."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import time

import pytest

from specsched.client.sync_client import AsyncClient, Client

pytestmark = pytest.mark.slow
NUM_CLIENTS, PER_CLIENT = 20, 15  # 300 requests


def read(path, sql: str) -> list[tuple]:
    db = sqlite3.connect(path)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def client_ids(rows: list[tuple]) -> list[str]:
    """The client's ids of engine request ids ``<client hex>:<id>``."""
    return [rid.split(":", 1)[1] for (rid,) in rows]


async def burst_then_kill(d) -> dict[str, int]:
    """NUM_CLIENTS clients send PER_CLIENT short requests each; the task that receives the last
    ``done`` SIGKILLs the daemon at once. Returns id -> output tokens, of every done received."""
    done: dict[str, int] = {}

    async def one(k: int) -> None:
        async with AsyncClient(d.endpoint, timeout_s=60) as c:
            for j in range(PER_CLIENT):
                prompt = [3 + k, 4, 5, 3 + k, 4, 5 + j % 3]
                r = await c.generate(prompt_ids=prompt, max_tokens=2 + (k + j) % 4, id=f"c{k}-{j}")
                done[r.id] = r.usage.completion_tokens
                if len(done) == NUM_CLIENTS * PER_CLIENT:
                    d.proc.kill()  # SIGKILL right after the last done: no handler, no flush, no wait

    await asyncio.gather(*(one(k) for k in range(NUM_CLIENTS)))
    return done


def check_all_logged_after_kill(start_daemon, log_path, **log) -> None:
    d = start_daemon(log_path=log_path, log={"flush_interval_s": 0.5, **log})  # the production interval
    done = asyncio.run(burst_then_kill(d))
    assert d.proc.wait(10) == -signal.SIGKILL
    assert len(done) == NUM_CLIENTS * PER_CLIENT
    assert read(log_path, "PRAGMA integrity_check") == [("ok",)]
    run = read(log_path, "SELECT MAX(id) FROM runs")[0][0]
    rows = read(log_path, f"SELECT request_id, output_tokens FROM requests WHERE run_id = {run}")
    logged = {rid.split(":", 1)[1]: n for rid, n in rows}
    missing = sorted(set(done) - set(logged))
    assert not missing, f"{len(missing)} of {len(done)} requests got done but are not in the log: {missing}"
    assert {rid: logged[rid] for rid in done} == done
    stepped = set(
        client_ids(read(log_path, f"SELECT DISTINCT request_id FROM step_requests WHERE run_id = {run}"))
    )
    assert set(done) <= stepped, sorted(set(done) - stepped)[:10]


def test_every_done_is_in_the_log_after_kill_9(start_daemon, tmp_path):
    check_all_logged_after_kill(start_daemon, tmp_path / "durable.sqlite")


@pytest.mark.soak
def test_every_done_is_in_the_log_after_kill_9_soak(start_daemon, tmp_path):
    log_path = tmp_path / "durable-soak.sqlite"  # five runs appended to one file
    for _ in range(5):
        check_all_logged_after_kill(start_daemon, log_path)
    assert [r[0] for r in read(log_path, "SELECT id FROM runs ORDER BY id")] == [1, 2, 3, 4, 5]


def test_done_waits_for_the_commit_not_for_the_flush_interval(start_daemon, tmp_path):
    """durable: with a 60 s flush interval the row is still committed before the done arrives."""
    log_path = tmp_path / "commit.sqlite"
    d = start_daemon(log_path=log_path, log={"flush_interval_s": 60.0})
    with Client(d.endpoint, timeout_s=30) as c:
        for i in range(5):
            t = time.perf_counter()
            c.generate(prompt_ids=[5, 6, 7], max_tokens=3, id=f"r{i}")
            assert time.perf_counter() - t < 10.0  # not the flush interval
            assert client_ids(read(log_path, "SELECT request_id FROM requests")) == [
                f"r{k}" for k in range(i + 1)
            ]
    assert d.stop() == 0


def test_durable_false_sends_done_before_the_row_is_written(start_daemon, tmp_path):
    """The old mode: done at once, the rows wait for the flush interval (60 s here) or shutdown."""
    log_path = tmp_path / "loose.sqlite"
    d = start_daemon(log_path=log_path, log={"durable": False, "flush_interval_s": 60.0})
    with Client(d.endpoint, timeout_s=30) as c:
        ids = [c.generate(prompt_ids=[5, 6, 7], max_tokens=3, id=f"r{i}").id for i in range(5)]
        assert read(log_path, "SELECT COUNT(*) FROM requests") == [(0,)]
    assert d.stop() == 0  # SIGTERM flushes
    assert sorted(client_ids(read(log_path, "SELECT request_id FROM requests"))) == ids


def test_sigterm_releases_every_held_done(start_daemon, tmp_path):
    """Shutdown without grace aborts 24 requests in flight: every one gets its done and its row."""
    log_path = tmp_path / "sigterm.sqlite"
    d = start_daemon(
        log_path=log_path, log={"flush_interval_s": 60.0}, daemon={"max_inflight_per_client": 32}
    )

    async def main() -> list[str]:
        async with AsyncClient(d.endpoint, timeout_s=30) as c:
            streams = [c.stream(prompt_ids=[4, 5, 6 + i], max_tokens=400, id=f"s{i}") for i in range(24)]
            for s in streams:
                await s.__anext__()  # all 24 are running
            d.proc.send_signal(signal.SIGTERM)
            for s in streams:
                async for _ in s:
                    pass
            assert {s.done.finish_reason for s in streams} == {"abort"}
            return [s.done.id for s in streams]

    ids = asyncio.run(main())
    assert d.proc.wait(30) == 0, d.output()
    assert sorted(client_ids(read(log_path, "SELECT request_id FROM requests"))) == sorted(ids)
