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


def imported_modules(output: str) -> set[str]:
    """The modules a process imported, from its ``-X importtime`` lines."""
    return {
        line.rsplit("|", 1)[1].strip() for line in output.splitlines() if line.startswith("import time:")
    } - {"package"}  # the header line's last column


@pytest.fixture(scope="module")
def warm_text_daemon(start_cli_daemon, tiny_hf_dir, tmp_path_factory):
    """A daemon with a tokenizer (the tiny HF folder) started a second time on the same cache (its
    tokenizer checked against transformers' by the first start), with ``-X importtime``."""
    cache = tmp_path_factory.mktemp("warm-cache")
    overrides = (f"model.source={tiny_hf_dir}", f"model.cache_dir={cache}", "log=none")
    first = start_cli_daemon(*overrides)
    assert "the transformers-free tokenizer behaves as transformers' (checked)" in first.output()
    first.stop()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPROFILEIMPORTTIME", "1")
        return start_cli_daemon(*overrides)


@pytest.mark.slow
def test_a_warm_start_serves_text_without_importing_transformers(warm_text_daemon):
    with Client(warm_text_daemon.endpoint, timeout_s=30) as client:
        got = client.generate(messages=[{"role": "user", "content": "Grüße"}], max_tokens=4)
        assert got.usage.prompt_tokens > 0 and len(got.token_ids) == 4
    imported = imported_modules(warm_text_daemon.output())
    assert {"torch", "tokenizers", "jinja2"} <= imported  # the transformers-free tokenizer served
    assert not {m for m in imported if m.split(".")[0] == "transformers"}


@pytest.mark.slow
def test_a_start_without_a_log_does_not_import_sqlite_utils(warm_text_daemon):
    assert "sqlite_utils" not in imported_modules(warm_text_daemon.output())
