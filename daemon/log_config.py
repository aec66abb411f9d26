"""The decision log writer's config (hydra group ``log``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LogConfig:
    path: str | None = None  # SQLite file; None = no log
    flush_interval_s: float = 0.5  # longest a record waits in memory (what a crash can lose)
    batch_size: int = 256  # records that trigger a write before the interval ends
    queue_max: int = 100_000  # records held in memory at most (queue + retry buffer); more are dropped
    busy_timeout_s: float = 1.0  # wait for a locked database before counting the write as failed

    def __post_init__(self) -> None:
        if self.path is not None and not str(self.path).strip():
            raise ValueError("log.path must be a file path or null (no log), got an empty string")
        if not self.flush_interval_s > 0:
            raise ValueError(f"log.flush_interval_s must be > 0, got {self.flush_interval_s}")
        if self.batch_size < 1:
            raise ValueError(f"log.batch_size must be >= 1, got {self.batch_size}")
        if self.queue_max < self.batch_size:
            raise ValueError(
                f"log.queue_max must be >= log.batch_size ({self.batch_size}), got {self.queue_max}"
            )
        if self.busy_timeout_s < 0:
            raise ValueError(f"log.busy_timeout_s must be >= 0, got {self.busy_timeout_s}")
