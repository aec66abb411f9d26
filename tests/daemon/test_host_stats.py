"""The daemon's host counters in ``stats`` (daemon/host_stats.py): the parsers on /proc text, and the
real daemon on loopback reporting its engine thread's switches, CPU and the process's huge pages."""

from __future__ import annotations

import os
import threading
import time

import pytest

from specsched.client.sync_client import Client
from specsched.daemon.host_stats import (
    host_stats,
    read_anon_huge_pages,
    read_last_cpu,
    read_schedstat,
    read_switches,
)

STATUS = (
    "Name:\tpython\nState:\tS (sleeping)\nvoluntary_ctxt_switches:\t1234\nnonvoluntary_ctxt_switches:\t56\n"
)
# a command name with spaces and a ')' inside: fields are counted after the last ')'
STAT = "4242 (specsched) engine) S " + " ".join(map(str, range(1, 36))) + " 7 37 38"
ROLLUP = "Rss:  1000 kB\nAnonymous:  800 kB\nAnonHugePages:   2048 kB\nShmemHugePages:  0 kB\n"


def test_the_parsers_read_the_fields_they_name():
    assert read_switches(STATUS) == (1234, 56)
    assert read_switches("Name:\tpython\n") is None
    assert read_last_cpu(STAT) == 7  # field 39: the 37th after the command name
    assert read_last_cpu("no parenthesis here") is None
    assert read_anon_huge_pages(ROLLUP) == 2048 * 1024
    assert read_anon_huge_pages("Rss: 1 kB\n") is None
    assert read_schedstat("2500000000 125000000 17\n") == (2.5, 0.125)
    assert read_schedstat("") is None


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_host_stats_of_a_live_thread_count_its_switches():
    waited, release = threading.Event(), threading.Event()
    tid: list[int] = []

    def body() -> None:
        tid.append(threading.get_native_id())
        for _ in range(20):  # voluntary switches: it sleeps
            time.sleep(0.001)
        end = time.thread_time() + 0.05  # and 50 ms on a CPU
        while time.thread_time() < end:
            pass
        waited.set()
        release.wait(10)  # alive while its counters are read

    t = threading.Thread(target=body)
    t.start()
    try:
        assert waited.wait(10)
        got = host_stats(tid[0], threading.get_native_id(), tid[0])
    finally:
        release.set()
        t.join()
    assert (
        got is not None and got.engine_voluntary_switches is not None and got.engine_voluntary_switches >= 1
    )
    assert got.engine_nonvoluntary_switches is not None and got.engine_nonvoluntary_switches >= 0
    assert got.engine_last_cpu in os.sched_getaffinity(0)
    assert got.num_threads is not None and got.num_threads >= 2
    # CPU seconds: the busy thread's 50 ms at least, the same thread read as "log" alike; this thread's own
    assert 0.05 <= got.engine_cpu_s < 10 and got.engine_runqueue_s >= 0
    assert got.log_cpu_s == pytest.approx(got.engine_cpu_s, abs=0.01)
    assert got.io_cpu_s is not None and 0 < got.io_cpu_s <= got.process_cpu_s
    assert host_stats(tid[0], proc="/nonexistent") is None  # no /proc: nothing to say


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_the_daemon_reports_its_engine_thread_in_stats(start_daemon):
    d = start_daemon()
    with Client(d.endpoint, timeout_s=60) as c:
        before = c.stats().host
        assert len(c.generate(prompt_ids=[5, 6, 7, 5, 6, 7, 5, 6], max_tokens=8).token_ids) == 8
        after = c.stats().host
    assert before is not None and after is not None
    # the same thread's counters only grow, and serving switched it out at least once (its own waits,
    # or on a loaded box the scheduler taking its CPU)
    assert after.engine_voluntary_switches >= before.engine_voluntary_switches
    assert after.engine_nonvoluntary_switches >= before.engine_nonvoluntary_switches
    assert (after.engine_voluntary_switches + after.engine_nonvoluntary_switches
            > before.engine_voluntary_switches + before.engine_nonvoluntary_switches)  # fmt: skip
    assert after.engine_last_cpu in os.sched_getaffinity(d.proc.pid)
    assert after.num_threads >= 2  # the engine and IO threads at least
    assert after.anon_huge_pages_bytes is None or after.anon_huge_pages_bytes >= 0
    # the threads' CPU seconds grow with the work: the engine thread ran a request, the IO thread
    # answered stats and streamed; the log writer wrote its rows (the fixture's daemon logs)
    assert after.engine_cpu_s > before.engine_cpu_s and after.io_cpu_s > before.io_cpu_s
    assert after.process_cpu_s >= after.engine_cpu_s + after.io_cpu_s - 0.01
    assert after.log_cpu_s is None or after.log_cpu_s >= before.log_cpu_s
    d.stop()
