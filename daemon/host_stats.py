"""What the kernel says about the daemon's process and its engine thread (Linux /proc), for ``stats``.

On an H100 host on 2026-12-07 daemons of one benchmark run kept different host speeds for their whole
life: every host phase of some ran 10-25 % slower than others' on the same code path, and two daemons
of one policy ran 14.6 % apart at N = 4 (docs/benchmarks.md). Their engine threads are all pinned to
one CPU, so the cause is elsewhere; these counters are the first suspects, cheap to read:

- the engine thread's context switches: *nonvoluntary* ones are the scheduler taking its CPU away
  (another thread or process on it); voluntary ones are its own waits (the GPU, the interpreter lock,
  its queue);
- the CPU it last ran on (``processor`` of its ``stat``);
- the process's anonymous memory in transparent huge pages (``AnonHugePages`` of ``smaps_rollup``): a
  heap that got huge pages walks its objects with fewer TLB misses than one that did not;
- the CPU seconds of the engine, IO and log-writer threads (``schedstat``: ns on a CPU, and for the
  engine thread the ns it was runnable but waited for one) and of the whole process: over a loop,
  their deltas over its wall time say how busy each thread was (on CUDA the engine thread spins
  while it waits for the device, so its own share is near 1 regardless; the IO and log threads' shares
  are the interpreter lock they take from it).

Read on the IO thread when a ``stats`` reply is built, not per step: ``smaps_rollup`` walks the
process's mappings (a millisecond or so on a large CUDA process), so a client polling ``stats`` in a
tight loop pays for it.
"""

from __future__ import annotations

import os
import time

from specsched.daemon.messages import HostStats

__all__ = ["host_stats", "read_switches", "read_last_cpu", "read_anon_huge_pages", "read_schedstat"]


def read_switches(status_text: str) -> tuple[int, int] | None:
    """(voluntary, nonvoluntary) context switches of a /proc ``status`` file; None when absent."""
    found = {}
    for line in status_text.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            found[key] = int(value.split()[0])
    if len(found) != 2:
        return None
    return found["voluntary_ctxt_switches"], found["nonvoluntary_ctxt_switches"]


def read_last_cpu(stat_text: str) -> int | None:
    """The CPU a thread last ran on: field 39 (``processor``) of a /proc ``stat`` line; the command
    name (field 2, in parentheses) may hold spaces, so the fields are counted after its ``)``."""
    _, sep, rest = stat_text.rpartition(")")
    if not sep:
        return None
    parts = rest.split()  # parts[0] is field 3 (state)
    return int(parts[36]) if len(parts) > 36 else None


def read_anon_huge_pages(smaps_rollup_text: str) -> int | None:
    """Bytes of ``AnonHugePages`` in a /proc ``smaps_rollup`` file; None when absent."""
    for line in smaps_rollup_text.splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return None


def read_schedstat(text: str) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of a /proc ``schedstat`` line (ns)."""
    parts = text.split()
    if len(parts) < 2:
        return None
    return int(parts[0]) / 1e9, int(parts[1]) / 1e9


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def host_stats(
    engine_tid: int | None, io_tid: int | None = None, log_tid: int | None = None, proc: str = "/proc"
) -> HostStats | None:
    """The counters of the module docstring for thread ``engine_tid`` of this process (None: the
    process's only) and the CPU seconds of threads ``io_tid`` and ``log_tid`` (kernel ids; None: not
    read), or None where /proc has none of them (not Linux)."""
    task = f"{proc}/self/task/{engine_tid}" if engine_tid is not None else f"{proc}/self"
    status, stat = _read(f"{task}/status"), _read(f"{task}/stat")
    rollup = _read(f"{proc}/self/smaps_rollup")
    switches = read_switches(status) if status else None
    if switches is None and stat is None and rollup is None:
        return None
    engine = _schedstat(proc, engine_tid) if engine_tid is not None else None
    return HostStats(
        engine_voluntary_switches=switches[0] if switches else None,
        engine_nonvoluntary_switches=switches[1] if switches else None,
        engine_last_cpu=read_last_cpu(stat) if stat else None,
        anon_huge_pages_bytes=read_anon_huge_pages(rollup) if rollup else None,
        num_threads=len(os.listdir(f"{proc}/self/task")) if os.path.isdir(f"{proc}/self/task") else None,
        engine_cpu_s=engine[0] if engine else None,
        engine_runqueue_s=engine[1] if engine else None,
        io_cpu_s=_cpu_s(proc, io_tid),
        log_cpu_s=_cpu_s(proc, log_tid),
        process_cpu_s=time.process_time(),
    )


def _schedstat(proc: str, tid: int) -> tuple[float, float] | None:
    text = _read(f"{proc}/self/task/{tid}/schedstat")
    return read_schedstat(text) if text else None


def _cpu_s(proc: str, tid: int | None) -> float | None:
    found = _schedstat(proc, tid) if tid is not None else None
    return found[0] if found else None
