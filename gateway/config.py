"""The gateway's one config layer: where the daemon is, where the HTTP server listens, who may call it.

hydra reads this dataclass as the whole ``specsched-gateway`` config (conf/gateway.yaml); it is built
with ``OmegaConf.to_object`` at the entry point (cli.py) and validated here.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class GatewayConfig:
    daemon_endpoint: str = "tcp://127.0.0.1:5555"  # the daemon's ZeroMQ endpoint (no CURVE: loopback / ipc)
    host: str = "127.0.0.1"  # HTTP bind address; anything but loopback needs api_key
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* need "Authorization: Bearer <api_key>" (else 401)
    model: str | None = None  # the model name served; None = the name the daemon's health reports
    default_max_tokens: int = 512  # for a request without max_tokens (the daemon caps it to the context)
    reply_timeout_s: float = 60.0  # longest wait for the daemon's next reply (a chunk) of a request -> 504
    health_timeout_s: float = 2.0  # each request first asks the daemon's health; no reply this soon -> 503
    request_timeout_s: float | None = None  # the daemon-side deadline of each request; None = the daemon's
    max_message_bytes: int = 1 << 20  # should match the daemon's daemon.max_message_bytes
    log_level: str = "info"  # uvicorn's: critical | error | warning | info | debug | trace

    def __post_init__(self) -> None:
        if not isinstance(self.daemon_endpoint, str) or not self.daemon_endpoint.startswith(ENDPOINT_SCHEMES):
            raise ValueError(
                f"daemon_endpoint must start with one of {', '.join(ENDPOINT_SCHEMES)}, "
                f"got {self.daemon_endpoint!r}"
            )
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (use null for no key)")
        if self.api_key is None and not is_loopback(self.host):
            raise ValueError(
                f"host {self.host!r} is not a loopback address: set api_key (e.g. "
                "api_key=${oc.env:SPECSCHED_API_KEY}) to serve other machines"
            )
        if self.model is not None and not self.model:
            raise ValueError("model must not be empty (use null to take the daemon's name)")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        for name in ("reply_timeout_s", "health_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value}")
        t = self.request_timeout_s
        if t is not None and not (math.isfinite(t) and t > 0):
            raise ValueError(f"request_timeout_s must be > 0 or null, got {t}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        levels = ("critical", "error", "warning", "info", "debug", "trace")
        if self.log_level not in levels:
            raise ValueError(f"log_level must be one of {', '.join(levels)}, got {self.log_level!r}")
