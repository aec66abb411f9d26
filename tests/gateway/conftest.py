"""Fixtures for the gateway tests: the real daemon (tests/daemon/conftest.py's launchers, imported by
path: a non-root conftest cannot use ``pytest_plugins``) and the real gateway CLI as a subprocess.

``gateway_daemon`` is this package's own text daemon (a tiny HF checkpoint with a byte-level BPE
tokenizer and a chat template), since a test stops and restarts it; ``start_gateway(endpoint,
*overrides)`` runs ``python -m specsched.gateway`` on a free loopback port and waits until it answers.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


def _load_daemon_fixtures():
    path = Path(__file__).resolve().parents[1] / "daemon" / "conftest.py"
    spec = importlib.util.spec_from_file_location("specsched_tests_daemon_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


daemon_fixtures = _load_daemon_fixtures()
start_daemon = daemon_fixtures.start_daemon  # the session fixture, registered for this folder too
free_port = daemon_fixtures.free_port


@pytest.fixture(scope="session")
def text_model(tiny_hf_dir, tmp_path_factory) -> dict:
    """The ``model`` launch options of the text daemon (a restart must load the same)."""
    return {"source": str(tiny_hf_dir), "cache_dir": str(tmp_path_factory.mktemp("model-cache"))}


@pytest.fixture(scope="session")
def gateway_daemon(start_daemon, text_model):
    return start_daemon(model=text_model)


@dataclass
class GatewayProcess:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    output_path: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until the HTTP server answers at all (``/health`` may say 503 while the daemon is down)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited with {self.proc.returncode}:\n{self.output()}")
            try:
                httpx.get(self.url + "/health", timeout=5.0)
                return
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError(f"gateway not answering within {timeout_s} s:\n{self.output()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def launch_gateway(tmp_dir: Path, endpoint: str, *overrides: str) -> GatewayProcess:
    """``python -m specsched.gateway daemon_endpoint=... port=<free> *overrides``, not waited for."""
    port = free_port()
    out = tmp_dir / "gateway.out"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = [f"daemon_endpoint={endpoint}", f"port={port}", "log_level=warning", *overrides]
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "specsched.gateway", *args], cwd=tmp_dir, stdout=f,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip
    return GatewayProcess(f"http://127.0.0.1:{port}", proc, out)


@pytest.fixture(scope="session")
def start_gateway(tmp_path_factory):
    """``start_gateway(endpoint, *overrides, wait=True) -> GatewayProcess``; stopped at session end."""
    started: list[GatewayProcess] = []

    def start(endpoint: str, *overrides: str, wait: bool = True) -> GatewayProcess:
        g = launch_gateway(tmp_path_factory.mktemp("gateway"), endpoint, *overrides)
        started.append(g)
        if wait:
            g.wait_ready()
        return g

    yield start
    for g in started:
        g.stop()
