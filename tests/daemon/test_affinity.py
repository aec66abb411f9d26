"""``daemon.engine_cpu``: the real daemon's engine thread runs on that CPU only, every other thread of
the process on the others, and serving goes on; a CPU the process may not use is refused by name."""

from __future__ import annotations

import os

import pytest

from specsched.client.sync_client import Client
from specsched.daemon.affinity import check_cpu, core_siblings, other_cpus, pin_engine_thread
from specsched.daemon.limits import DaemonConfig

needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least 2 CPUs",
)


def thread_cpus(pid: int) -> dict[int, set[int]]:
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@needs_two_cpus
def test_daemon_pins_its_engine_thread_and_keeps_the_others_off_its_cpu(start_daemon):
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[-1]
    d = start_daemon(daemon={"engine_cpu": cpu})
    with Client(d.endpoint, timeout_s=60) as c:
        done = c.generate(prompt_ids=[5, 6, 7, 5, 6, 7, 5, 6], max_tokens=8)
    assert len(done.token_ids) == 8
    by_thread = thread_cpus(d.proc.pid)
    pinned = [t for t, s in by_thread.items() if s == {cpu}]
    assert pinned, f"no thread runs on CPU {cpu} alone: {by_thread}"
    others = [s for t, s in by_thread.items() if t not in pinned]
    assert others, "the daemon should have threads besides the engine's (IO, ZeroMQ)"
    assert all(cpu not in s for s in others), by_thread
    assert all(s == other_cpus(cpu, set(cpus)) for s in others), by_thread  # off its core's siblings too
    assert "engine thread pinned to CPU" in d.output()
    d.stop()


@needs_two_cpus
def test_pin_engine_thread_moves_every_other_thread(tmp_path):
    import threading

    cpus = sorted(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    ready, release = threading.Event(), threading.Event()
    tid: list[int] = []

    def body() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        release.wait(10)

    t = threading.Thread(target=body)
    t.start()
    try:
        ready.wait(10)
        pin_engine_thread(tid[0], cpus[0])
        assert os.sched_getaffinity(tid[0]) == {cpus[0]}
        # this (the calling) thread moved off it, and off its hyperthread siblings where others are left
        mine = os.sched_getaffinity(0)
        assert mine == other_cpus(cpus[0], set(cpus)) and cpus[0] not in mine
    finally:
        release.set()
        t.join()
        os.sched_setaffinity(0, before)


def test_a_cpu_the_process_may_not_use_is_refused_by_name():
    if not hasattr(os, "sched_getaffinity"):
        with pytest.raises(ValueError, match="needs Linux"):
            check_cpu(0)
        return
    bad = max(os.sched_getaffinity(0)) + 1000
    with pytest.raises(ValueError, match=rf"daemon.engine_cpu={bad} is not a CPU this process may run on"):
        check_cpu(bad)
    with pytest.raises(ValueError, match="engine_cpu must be >= 0"):
        DaemonConfig(engine_cpu=-1)
    with pytest.raises(ValueError, match=rf"daemon.engine_cpu={bad} is not a CPU"):
        DaemonConfig(engine_cpu=bad)  # when the config is resolved, before the model loads


def fake_topology(root, siblings: dict[int, str]) -> str:
    for cpu, text in siblings.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    return str(root)


def test_the_other_threads_stay_off_the_engine_cpu_s_whole_core(tmp_path):
    # 8 cores x 2 hyperthreads, siblings numbered apart (CPU i and i + 8 share a core)
    sysfs = fake_topology(tmp_path / "smt", {i: f"{i % 8},{i % 8 + 8}" for i in range(16)})
    assert core_siblings(11, sysfs) == {3, 11}
    assert other_cpus(11, set(range(16)), sysfs) == set(range(16)) - {3, 11}
    # a benchmark daemon's half of the machine: cores 0-3 with their siblings
    daemon = {0, 1, 2, 3, 8, 9, 10, 11}
    assert other_cpus(11, daemon, sysfs) == {0, 1, 2, 8, 9, 10}
    # the core is all there is: the other threads share its sibling rather than nothing
    assert other_cpus(11, {3, 11}, sysfs) == {3}
    # siblings numbered together (0-1, 2-3, ...), and no topology at all (one CPU per core)
    pairs = fake_topology(tmp_path / "pairs", {i: f"{i - i % 2}-{i - i % 2 + 1}" for i in range(4)})
    assert other_cpus(3, {0, 1, 2, 3}, pairs) == {0, 1}
    assert other_cpus(3, {0, 1, 2, 3}, str(tmp_path / "none")) == {0, 1, 2}
