"""The decision log writer's config (hydra group ``log``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LogConfig:
    path: str | None = None  # SQLite file; None = no log
    # durable: a request's done leaves only once its requests row (and its steps) are committed
    # (group commit, docs/logging.md); false: done at once, a kill -9 loses up to flush_interval_s
    durable: bool = True
    commit_interval_ms: float = 2.0  # durable: at most one commit per interval while requests finish
    flush_interval_s: float = 0.5  # longest a step record waits in memory (durable=false: any record)
    batch_size: int = 256  # records that trigger a write before the interval ends
    queue_max: int = 100_000  # records held in memory at most (queue + retry buffer); more are dropped
    busy_timeout_s: float = 1.0  # wait for a locked database before counting the write as failed
    # When the writer thread takes records off its queue (each costs it ~20-40 us of Python, which
    # the engine thread waits for whenever it lets go of the interpreter lock): "record" as each is
    # enqueued; "step" once per engine step, when the engine waits for the device (its verification
    # read), where the engine needs no lock (daemon/log.py: LogWriter.nudge); "step" since the H200 A/B
    # of 2026-12-05 11:03 (with daemon.send_pace=step; docs/benchmarks.md)
    pace: str = "step"

    def __post_init__(self) -> None:
        if self.path is not None and not str(self.path).strip():
            raise ValueError("log.path must be a file path or null (no log), got an empty string")
        if not isinstance(self.durable, bool):
            raise ValueError(f"log.durable must be true or false, got {self.durable!r}")
        if not 0 <= self.commit_interval_ms <= 1000:
            raise ValueError(f"log.commit_interval_ms must be in [0, 1000], got {self.commit_interval_ms}")
        if not self.flush_interval_s > 0:
            raise ValueError(f"log.flush_interval_s must be > 0, got {self.flush_interval_s}")
        if self.batch_size < 1:
            raise ValueError(f"log.batch_size must be >= 1, got {self.batch_size}")
        if self.queue_max < self.batch_size:
            raise ValueError(
                f"log.queue_max must be >= log.batch_size ({self.batch_size}), got {self.queue_max}"
            )
        if self.pace not in ("record", "step"):
            raise ValueError(f"log.pace must be record or step, got {self.pace!r}")
        if self.busy_timeout_s < 0:
            raise ValueError(f"log.busy_timeout_s must be >= 0, got {self.busy_timeout_s}")
