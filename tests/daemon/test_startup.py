"""The daemon's start-up breakdown: ``specsched-serve`` (a real process on loopback) reports the seconds
from its process's start to each milestone in its log and in ``stats``, in the order they happen."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import pytest

from specsched.client.sync_client import Client
from specsched.daemon.protocol import StartupStats


def process_age_s(pid: int) -> float:
    """How long process ``pid`` has run, from /proc (as the daemon reads its own)."""
    start_ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process start from /proc")
def test_cli_daemon_reports_its_start_up_in_order_in_stats_and_its_log(start_cli_daemon, tmp_path):
    d = start_cli_daemon(f"log.path={tmp_path / 'log.sqlite'}")
    with Client(d.endpoint, timeout_s=30) as client:
        startup = client.stats().startup
        again = client.stats().startup
    assert isinstance(startup, StartupStats) and again == startup  # measured once, at listening
    assert startup.clock == "proc" and startup.conversion == "none"  # model=tiny: a preset
    reached = {f.name: getattr(startup, f.name) for f in fields(startup) if f.name.endswith("_s")}
    reached = {name: s for name, s in reached.items() if s is not None}
    assert list(reached) == [
        "imports_s", "config_s", "weights_s", "prebuild_s", "kv_cache_s", "graphs_s", "warmup_s", "log_s",
        "listening_s",
    ]  # fmt: skip
    assert list(reached.values()) == sorted(reached.values()), reached  # monotonic
    assert 0.0 < startup.imports_s  # the interpreter and the imports before the entry point ran
    assert startup.listening_s <= process_age_s(d.proc.pid) + 0.05  # from the process's own start
    lines = [line for line in d.output().splitlines() if " s from process start (clock " in line]
    assert len(lines) == 1, d.output()
    assert f"start-up {startup.listening_s:.2f} s from process start (clock proc): imports " in lines[0]
    out = d.output()
    assert out.index(" s from process start (clock ") < out.index("specsched daemon listening on ")
