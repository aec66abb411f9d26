"""Pinning the daemon's engine thread to one CPU (``daemon.engine_cpu``, Linux).

The engine thread runs the whole serving loop; everything else in the process (the IO thread, the
decision log's writer, ZeroMQ's own threads, the main thread) competes with it for the interpreter
lock and, when they share its CPU, for the CPU itself. Pinning the engine thread to one CPU and every
other thread of the process to the remaining ones keeps its caches warm and its speed that of one
known CPU. On the H200 host (2026-12-04 21:20, ``bench=serve_rounds``) two daemons of one config
differed by up to 5 % in the host time of every phase, for their whole life: the engine thread's
placement is the likely cause, and the benchmark now pins every daemon's engine thread to the same
CPU so that configs compare on equal terms. "Remaining" leaves out the engine CPU's hyperthread
siblings too (sysfs ``topology/thread_siblings_list``): a sibling shares the core's execution units
and caches, so a busy IO or log thread there would slow every phase of the engine thread.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)
SYSFS_CPU = "/sys/devices/system/cpu"


def cpu_list(text: str) -> list[int]:
    """A sysfs CPU list (``0,8`` or ``0-1``) as ints."""
    out: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def core_siblings(cpu: int, sysfs: str = SYSFS_CPU) -> set[int]:
    """The CPUs on ``cpu``'s physical core, ``cpu`` included (``{cpu}`` where sysfs cannot tell)."""
    try:
        with open(f"{sysfs}/cpu{cpu}/topology/thread_siblings_list") as f:
            return set(cpu_list(f.read())) | {cpu}
    except (OSError, ValueError):
        return {cpu}


def other_cpus(cpu: int, allowed: set[int], sysfs: str = SYSFS_CPU) -> set[int]:
    """Where the process's other threads run once the engine thread has ``cpu``: ``allowed`` less
    ``cpu``'s whole physical core, or less ``cpu`` alone where the core's siblings are all that is
    left (empty: nothing else to run on)."""
    rest = allowed - core_siblings(cpu, sysfs)
    return rest if rest else allowed - {cpu}


def check_cpu(cpu: int) -> set[int]:
    """The process's other CPUs; raises ValueError when ``cpu`` is not one it may run on, or when
    the platform cannot pin threads."""
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("daemon.engine_cpu needs Linux (os.sched_setaffinity); set it to null here")
    allowed = os.sched_getaffinity(0)
    if cpu not in allowed:
        raise ValueError(f"daemon.engine_cpu={cpu} is not a CPU this process may run on: {sorted(allowed)}")
    return allowed - {cpu}


def thread_ids() -> list[int]:
    """The kernel ids of this process's threads (Python's and native ones, e.g. ZeroMQ's)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def pin_engine_thread(engine_tid: int, cpu: int, sysfs: str = SYSFS_CPU) -> None:
    """Run thread ``engine_tid`` on ``cpu`` only and every other thread of the process on the other
    CPUs it may use, off ``cpu``'s physical core where others are left (:func:`other_cpus`; where there
    are none, they keep sharing). Threads created later inherit their creator's CPUs."""
    others = other_cpus(cpu, check_cpu(cpu) | {cpu}, sysfs)
    os.sched_setaffinity(engine_tid, {cpu})
    if not others:
        logger.warning("daemon.engine_cpu=%d is the process's only CPU: the other threads share it", cpu)
        return
    num_moved = 0
    for tid in thread_ids():
        if tid == engine_tid:
            continue
        try:
            os.sched_setaffinity(tid, others)
            num_moved += 1
        except OSError:  # the thread ended meanwhile
            pass
    logger.info("engine thread pinned to CPU %d; %d other threads on CPUs %s", cpu, num_moved, sorted(others))
