"""Process settings from the environment: the one place ``SPECSCHED_*`` variables are read.

Everything else (model, policy, endpoint, log path, ...) is hydra config; environment variables are
only for what belongs to the machine rather than the run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

ENV_PREFIX = "SPECSCHED_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

logger = logging.getLogger(__name__)


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "specsched")


@dataclass(frozen=True)
class Settings:
    """Machine-level settings. Field ``x`` is read from ``SPECSCHED_X``."""

    cache_dir: str = ""  # converted weights etc.; "" = ~/.cache/specsched
    log_level: str = "INFO"  # python logging level of the CLI entry points
    triton_cache_dir: str = ""  # Triton's on-disk kernel cache; "" = <cache_dir>/triton
    # processes compiling the start-up warm-up's attention variants (kernels/parallel_build.py);
    # 0 = auto (half the CPU cores, at most 8), 1 = compile them in the serving process only
    compile_workers: int = 0

    def apply_triton_cache(self) -> str:
        """Point Triton's on-disk kernel cache (``TRITON_CACHE_DIR``) at ours unless the user set it,
        so a restart loads the start-up warm-up's kernels instead of compiling them; returns it."""
        return os.environ.setdefault("TRITON_CACHE_DIR", self.triton_cache_dir)

    def __post_init__(self) -> None:
        level = self.log_level.upper()
        if level not in LOG_LEVELS:
            raise ValueError(
                f"{ENV_PREFIX}LOG_LEVEL must be one of {'|'.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        object.__setattr__(self, "log_level", level)
        object.__setattr__(self, "cache_dir", os.path.expanduser(self.cache_dir or _default_cache_dir()))
        triton_dir = os.path.expanduser(self.triton_cache_dir or os.path.join(self.cache_dir, "triton"))
        object.__setattr__(self, "triton_cache_dir", triton_dir)
        try:
            workers = int(self.compile_workers)
        except (TypeError, ValueError):
            raise ValueError(
                f"{ENV_PREFIX}COMPILE_WORKERS must be an integer >= 0, got {self.compile_workers!r}"
            ) from None
        if workers < 0:
            raise ValueError(f"{ENV_PREFIX}COMPILE_WORKERS must be >= 0, got {workers}")
        object.__setattr__(self, "compile_workers", workers)

    @property
    def num_compile_workers(self) -> int:
        """``compile_workers`` with auto (0) resolved for this machine."""
        if self.compile_workers:
            return self.compile_workers
        return max(1, min(8, available_cores() // 2))

    @classmethod
    def variables(cls) -> dict[str, str]:
        """Environment variable name -> field name."""
        return {ENV_PREFIX + f.name.upper(): f.name for f in fields(cls)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read the settings from ``environ`` (default ``os.environ``). An unknown ``SPECSCHED_*``
        variable (likely a typo) is warned about, naming the known ones."""
        env = os.environ if environ is None else environ
        known = cls.variables()
        unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
        if unknown:
            logger.warning(
                "ignoring unknown environment variable(s) %s; known: %s",
                ", ".join(unknown),
                ", ".join(sorted(known)),
            )
        return cls(**{name: env[var] for var, name in known.items() if var in env})


def load_settings() -> Settings:
    """The current process's settings (read fresh from ``os.environ`` on every call)."""
    return Settings.from_env()
