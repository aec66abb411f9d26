"""``daemon.switch_interval_ms``: Python's thread switch interval set for the daemon's life (a real
in-process daemon on loopback serving a request) and restored when it closes; bad values refused."""

from __future__ import annotations

import sys

import pytest

from specsched.client.sync_client import Client
from specsched.daemon.limits import DaemonConfig


@pytest.mark.parametrize("value", [0, -1.0, 0.001, 101, float("nan"), "fast", True])
def test_switch_interval_is_validated(value):
    with pytest.raises(ValueError, match=r"daemon.switch_interval_ms must be in \[0.01, 100\] ms or null"):
        DaemonConfig(switch_interval_ms=value)


def _serve_one(cfg: DaemonConfig) -> tuple[float, float]:
    """Start a real daemon (tiny model, loopback), serve one generate; -> the switch interval while it
    served and after it closed."""
    from specsched.daemon.server import Server
    from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig
    from specsched.engine.engine import Engine

    engine = Engine(
        EngineConfig(model=ModelConfig(source="tiny", device="cpu"), cache=CacheConfig(num_blocks=64))
    )
    srv = Server(engine, cfg, None)
    srv.start()
    try:
        with Client(srv.bound_endpoint, timeout_s=60) as c:
            out = c.generate(prompt_ids=[5, 6, 7, 5, 6, 7, 8], max_tokens=6)
        assert len(out.token_ids) == 6
        serving = sys.getswitchinterval()
    finally:
        srv.request_shutdown()
        assert srv.join(timeout=30)
        srv.close()
    after = sys.getswitchinterval()
    srv.close()  # idempotent: nothing left to restore
    assert sys.getswitchinterval() == after
    return serving, after


def test_the_daemon_sets_the_switch_interval_while_it_serves_and_restores_it():
    before = sys.getswitchinterval()
    assert abs(before - 0.0005) > 1e-6  # the test would not see a change otherwise
    serving, after = _serve_one(
        DaemonConfig(endpoint="tcp://127.0.0.1:0", shutdown_grace_s=0.0, switch_interval_ms=0.5)
    )
    assert serving == pytest.approx(0.0005)
    assert after == pytest.approx(before)


def test_by_default_the_daemon_leaves_the_switch_interval_alone():
    before = sys.getswitchinterval()
    serving, after = _serve_one(DaemonConfig(endpoint="tcp://127.0.0.1:0", shutdown_grace_s=0.0))
    assert serving == after == before
