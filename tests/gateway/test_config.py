"""GatewayConfig's checks and the real ``specsched-gateway`` CLI's handling of its config (no daemon)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specsched.gateway.config import GatewayConfig, is_loopback


def run_cli(*args: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specsched.gateway", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]"])
def test_loopback_hosts_need_no_key(host):
    assert is_loopback(host) and GatewayConfig(host=host).api_key is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com"])
def test_other_hosts_are_refused_without_an_api_key(host):
    assert not is_loopback(host)
    with pytest.raises(ValueError, match="not a loopback address: set api_key"):
        GatewayConfig(host=host)
    assert GatewayConfig(host=host, api_key="k").host == host


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("daemon_endpoint", "127.0.0.1:5555", "daemon_endpoint must start with"),
        ("port", 70000, "port must be in"),
        ("api_key", " ", "api_key must not be empty"),
        ("model", "", "model must not be empty"),
        ("default_max_tokens", 0, "default_max_tokens must be >= 1"),
        ("reply_timeout_s", 0.0, "reply_timeout_s must be > 0"),
        ("health_timeout_s", float("nan"), "health_timeout_s must be > 0"),
        ("request_timeout_s", -1.0, "request_timeout_s must be > 0 or null"),
        ("log_level", "loud", "log_level must be one of"),
    ],
)
def test_bad_values_are_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        GatewayConfig(**{field: value})


def test_cfg_job_prints_the_resolved_config_with_overrides(tmp_path):
    out = run_cli("daemon_endpoint=tcp://127.0.0.1:6000", "port=9001", "--cfg", "job", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "daemon_endpoint: tcp://127.0.0.1:6000" in out.stdout and "port: 9001" in out.stdout
    assert "api_key: null" in out.stdout


def test_the_cli_refuses_a_bad_config_with_a_clear_message(tmp_path):
    out = run_cli("host=0.0.0.0", tmp_path=tmp_path)
    assert out.returncode == 1 and "invalid config: host '0.0.0.0' is not a loopback address" in out.stderr
    typo = run_cli("prot=9000", tmp_path=tmp_path)  # the schema catches mistyped keys
    assert typo.returncode != 0 and "prot" in typo.stderr
    wrong = run_cli("port=many", tmp_path=tmp_path)
    assert wrong.returncode != 0 and "port" in wrong.stderr
