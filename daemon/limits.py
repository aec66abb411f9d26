"""The daemon's config: where it listens, who may connect (CURVE), and the limits that keep it alive under
load and hostile input. Every limit here is documented, with the error a client gets, in
docs/operations.md; hydra reads this dataclass as the ``daemon`` group (conf/daemon/default.yaml).

Limits, in the order a message meets them:

- ``max_message_bytes``: ZeroMQ's ``MAXMSGSIZE``; a larger message is dropped by ZeroMQ and the
  connection closed (no reply).
- ``max_inflight_per_client``: requests one connection has in flight -> ``too_many_inflight``.
- ``max_inflight``: requests all connections have in flight -> ``overloaded``.
- ``scheduler.max_queue``: requests admitted but not yet running -> ``overloaded`` (checked at once by
  the IO thread, and again, exactly, when the engine thread admits the request).
- ``max_prompt_tokens``: prompt length in tokens -> ``prompt_too_long``.
- ``max_output_tokens``: ``generate.max_tokens`` -> ``invalid_field``. (``max_tokens`` is also capped,
  silently, by what the model's context and the KV cache leave after the prompt.)
- ``request_timeout_s`` / ``generate.timeout``: deadline -> ``done`` with finish_reason ``timeout``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specsched.daemon.affinity import check_cpu
from specsched.daemon.auth import check_endpoint, check_key

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
OUTPUT_PACES = ("auto", "window", "loop")  # daemon.output_pace


@dataclass
class DaemonConfig:
    endpoint: str = "tcp://127.0.0.1:5555"  # any ZMQ endpoint; tcp://host:* binds a free port
    max_message_bytes: int = 1 << 20  # ZMQ MAXMSGSIZE: larger messages are dropped by ZMQ itself
    max_prompt_tokens: int | None = None  # None = the model's context - 1
    max_output_tokens: int | None = None  # cap on generate.max_tokens (more: invalid_field); None = none
    max_inflight_per_client: int = 256  # more: error too_many_inflight
    max_inflight: int = 4096  # all clients together; more: error overloaded
    request_timeout_s: float | None = None  # deadline of a generate that sends no timeout; None = none
    idle_sleep_ms: float = 50.0  # longest the idle engine thread sleeps (new work wakes it at once)
    shutdown_grace_s: float = 5.0  # SIGTERM: let in-flight requests finish this long, then abort
    linger_ms: int = 1000  # at close, how long queued replies may still go out
    send_hwm: int = 100_000  # messages queued per client; a client that falls further behind is dropped
    heartbeat_ivl_ms: int = 5000  # ZMTP heartbeats to detect dead peers; 0 = off
    heartbeat_timeout_ms: int = 15000
    stats_window_s: float = 10.0  # tokens/s window
    # Linux: run the engine thread on this CPU only and the daemon's other threads on its other CPUs
    # (daemon/affinity.py); null: leave placement to the OS
    engine_cpu: int | None = None
    # when a step's replies (chunks, dones) go out: "loop" = as each loop iteration ends; "step" = while
    # the engine's next step waits for the device (its verification read), so the IO thread's Python
    # work does not take the interpreter lock from the engine's host work (at once when idle). "step"
    # since the H200 A/B of 2026-12-05 11:03 (bench=serve_pacing_ab, with log.pace=step): +12-27 % tok/s
    # at N = 1-16 for goodput and k = 8; at N = 64 0 / -6 % and TTFT p50 +9-13 ms (docs/benchmarks.md)
    send_pace: str = "step"
    # where the engine thread turns a step's outputs into replies (stop strings, chunks, dones, request
    # rows) and hands its record to the log: "loop" = in the daemon's loop as the step returns, while
    # the device idles; "window" = during the next step's forward (the engine's on_host_window), off
    # the GPU's critical path; "auto" = window where the engine overlaps host work with the device
    # (CUDA), loop elsewhere (on the CPU the forward is the host's own work: nothing to hide behind)
    output_pace: str = "auto"
    # Python's thread switch interval while the daemon serves (sys.setswitchinterval; restored at close),
    # ms. A thread that wants the interpreter lock waits up to this long for the one holding it: with the
    # default (null = Python's 5 ms) a decide ahead of a few ms holds the IO and log-writer threads off
    # for all of the GPU's scoring, and their work then lands on the next step's critical path.
    switch_interval_ms: float | None = None
    # CURVE (docs/operations.md): required for any endpoint that is not loopback / ipc / inproc
    curve: bool = False
    curve_key_file: str | None = None  # the server's secret certificate; generated (0600) when missing
    curve_clients: list[str] = field(default_factory=list)  # allowed client public keys (Z85)
    curve_clients_file: str | None = None  # a file of client keys / certificates, or a directory of them

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str) or not self.endpoint.startswith(ENDPOINT_SCHEMES):
            raise ValueError(
                f"daemon.endpoint must start with one of {', '.join(ENDPOINT_SCHEMES)}, got {self.endpoint!r}"
            )
        for name in ("max_message_bytes", "max_inflight_per_client", "max_inflight", "send_hwm"):
            if getattr(self, name) < 1:
                raise ValueError(f"daemon.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"daemon.max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        for name in ("max_prompt_tokens", "max_output_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"daemon.{name} must be >= 1 or null, got {getattr(self, name)}")
        if self.engine_cpu is not None:
            if self.engine_cpu < 0:
                raise ValueError(f"daemon.engine_cpu must be >= 0 or null, got {self.engine_cpu}")
            check_cpu(self.engine_cpu)  # at start, before the model loads: one this process may use
        if self.send_pace not in ("loop", "step"):
            raise ValueError(f"daemon.send_pace must be loop or step, got {self.send_pace!r}")
        if self.output_pace not in OUTPUT_PACES:
            raise ValueError(
                f"daemon.output_pace must be one of {', '.join(OUTPUT_PACES)}, got {self.output_pace!r}"
            )
        si = self.switch_interval_ms
        is_number = isinstance(si, int | float) and not isinstance(si, bool)
        if si is not None and not (is_number and math.isfinite(si) and 0.01 <= si <= 100):
            raise ValueError(f"daemon.switch_interval_ms must be in [0.01, 100] ms or null, got {si!r}")
        t = self.request_timeout_s
        if t is not None and not (math.isfinite(t) and t > 0):
            raise ValueError(f"daemon.request_timeout_s must be > 0 or null, got {t}")
        for name in ("idle_sleep_ms", "stats_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"daemon.{name} must be > 0, got {getattr(self, name)}")
        for name in ("shutdown_grace_s", "linger_ms", "heartbeat_ivl_ms", "heartbeat_timeout_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"daemon.{name} must be >= 0, got {getattr(self, name)}")
        self.check_auth()

    def check_auth(self) -> None:
        """The endpoint / CURVE rules (also run by the server right before it binds)."""
        check_endpoint(self.endpoint, self.curve)
        if not self.curve:
            return
        if not self.curve_key_file:
            raise ValueError(
                "daemon.curve=true needs daemon.curve_key_file (the server's secret key file; "
                "it is generated there, mode 0600, when it does not exist)"
            )
        if not self.curve_clients and not self.curve_clients_file:
            raise ValueError(
                "daemon.curve=true needs the allowed client public keys: daemon.curve_clients=[...] "
                "or daemon.curve_clients_file=<file or directory>"
            )
        for i, key in enumerate(self.curve_clients):
            check_key(key, f"daemon.curve_clients[{i}]")
