"""The daemons of ``bench=serve``: one ``python -m specsched.daemon`` subprocess per config on a free
loopback port (:class:`Daemon`), its overrides, the cores it runs on, and the one-time weight
conversion before the first of them (:func:`prepare_weights`)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from specsched.bench.loopback import free_port
from specsched.bench.serve_config import DaemonRun, ServeConfig
from specsched.bench.serve_load import run_pass
from specsched.client.sync_client import Client
from specsched.daemon.affinity import SYSFS_CPU, core_siblings

logger = logging.getLogger(__name__)


def safe_name(name: str) -> str:
    return re.sub(r"[^\w.+-]+", "_", name).strip("_") or "config"


class Daemon:
    """``python -m specsched.daemon <overrides>`` on a free loopback port, output to ``log_file``."""

    def __init__(
        self, overrides: list[str], log_file: Path, env: dict[str, str], cpus: set[int] | None = None
    ) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.argv = [sys.executable, "-m", "specsched.daemon", *overrides, f"daemon.endpoint={self.endpoint}"]
        cpu = engine_cpu(cpus)
        is_own = any(o.startswith("daemon.engine_cpu=") for o in overrides)  # a config's own choice
        if cpu is not None and not is_own:  # every daemon's engine thread on one CPU: configs compare alike
            self.argv.append(f"daemon.engine_cpu={cpu}")
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = log_file
        self._out = log_file.open("w")
        self._out.write(" ".join(self.argv) + "\n")
        self._out.flush()
        self.t0 = time.perf_counter()
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        # one string hash seed for every daemon: dict and set layouts (and so their speed) alike
        env = {**os.environ, "PYTHONHASHSEED": "0", **env}
        self.proc = subprocess.Popen(self.argv, stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=pin)  # fmt: skip
        self.pid = self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from process start until ``health`` answered ok; raises when it exits or times out."""
        deadline = self.t0 + timeout_s
        with Client(self.endpoint, timeout_s=1.0) as c:
            while True:
                if not self.is_alive():
                    raise RuntimeError(f"daemon exited with status {self.proc.returncode} during start-up; "
                                       f"last lines of {self.log_file}:\n{self.tail()}")  # fmt: skip
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"daemon not healthy after {timeout_s:.0f} s; see {self.log_file}")
                try:
                    if c.health().status == "ok":
                        return time.perf_counter() - self.t0
                except Exception:  # not bound yet (the request times out) or still starting
                    time.sleep(0.2)

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, wait; SIGKILL when it does not exit within ``timeout_s``. Returns the exit status."""
        try:
            if self.is_alive():
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("daemon %d ignored SIGTERM for %.0f s: killed", self.pid, timeout_s)
                    self.proc.kill()
                    self.proc.wait(30)
            return self.proc.returncode
        finally:
            self._out.close()

    def tail(self, n: int = 15) -> str:
        self._out.flush()
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])


def prepare_weights(cfg: ServeConfig) -> dict:
    """``python -m specsched.models.prepare <source>`` before the first daemon, timed: the one-time
    weight conversion (GGUF: ~30 s for SmolLM2) then is not in the first daemon's start-up, which is
    the kernels' cold start. Returns {conversion: built | hit | none, seconds, error}."""
    cache = [o.split("=", 1)[1] for o in cfg.model_overrides if o.startswith("model.cache_dir=")]
    argv = [sys.executable, "-m", "specsched.models.prepare", cfg.source]
    argv += ["--cache-dir", cache[-1]] if cache else []
    t0 = time.perf_counter()
    try:
        done = subprocess.run(argv, env={**os.environ, **cfg.env}, capture_output=True, text=True,
                              timeout=cfg.startup_timeout_s)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"conversion": None, "seconds": time.perf_counter() - t0, "error": "timed out"}
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        return {"conversion": None, "seconds": seconds, "error": f"exit {done.returncode}: {tail[0]}"[:300]}
    words = done.stdout.split()
    conversion = words[1] if len(words) > 1 and words[1] in ("built", "hit", "none") else None
    logger.info("serve: weights of %s %s in %.1f s", cfg.source, conversion, seconds)
    return {"conversion": conversion, "seconds": seconds, "error": None}


def physical_cores(cpus: list[int], sysfs: str = SYSFS_CPU) -> list[list[int]]:
    """``cpus`` grouped by the physical core they run on (hyperthreads of one core together, from
    sysfs ``topology/thread_siblings_list``), in the order of each group's lowest CPU; one group per
    CPU where the topology cannot be read."""
    groups: dict[frozenset, list[int]] = {}
    for c in cpus:
        groups.setdefault(frozenset(core_siblings(c, sysfs)), []).append(c)
    return sorted(groups.values(), key=min)


def engine_cpu(cpus: set[int] | None) -> int | None:
    """The CPU a benchmark daemon's engine thread is pinned to (``daemon.engine_cpu``): the highest of
    the daemon's ``cpus`` (the lowest ones take more of the machine's interrupts), the same for every
    daemon of a run; None without at least 2 CPUs to split. On the H200 host (2026-12-04 21:20) two
    daemons of one config, unpinned, differed by up to 5 % in the host time of every phase."""
    return max(cpus) if cpus and len(cpus) >= 2 else None


def split_cpus(enabled: bool, sysfs: str = SYSFS_CPU) -> tuple[set[int] | None, set[int] | None]:
    """(daemon cores, client cores): the first and second half of this process's physical cores, each
    with all of its hyperthreads, so the load generator never runs on a sibling of a daemon's CPU
    (Linux, >= 4 CPUs, ``enabled``); else (None, None). Splitting logical CPUs in halves put each
    daemon CPU's sibling among the clients' wherever the siblings are numbered apart (0 and 8 on a
    16-CPU machine): the clients then slowed the daemon's engine thread by sharing its core."""
    if not enabled or not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 4:
        return None, None
    cores = physical_cores(cpus, sysfs)
    if len(cores) < 2:
        return None, None
    half = len(cores) // 2
    return {c for g in cores[:half] for c in g}, {c for g in cores[half:] for c in g}


def daemon_overrides(
    cfg: ServeConfig, run: DaemonRun, log_dir: Path | None, extra: list[str] = ()
) -> list[str]:
    log = [f"log.path={log_dir / (safe_name(run.name) + '.sqlite')}"] if log_dir else ["log=none"]
    if "log=none" in run.overrides:  # the config's own choice (a row without the log in an A/B)
        log = []
    return [f"model.source={cfg.source}", *cfg.model_overrides, *run.overrides, *extra, *log]


def daemon_env(cfg: ServeConfig, run: DaemonRun) -> dict[str, str]:
    """The extra environment of ``run``'s daemon: the bench's, then the config's own."""
    return {**cfg.env, **run.env}


def config_info(run: DaemonRun, daemon: Daemon) -> dict:
    """A config's row of the configs table, filled in as its daemon starts, serves and stops."""
    return {"name": run.name, "kind": run.kind, "overrides": run.overrides, "reference": run.reference,
            "startup_s": None,
            "exit_status": None, "error": None, "pid": daemon.pid, "compiles_total": None,
            "daemon_log": str(daemon.log_file), "argv": daemon.argv[3:]}  # fmt: skip


def start_up(cfg: ServeConfig, name: str, daemon: Daemon, prompts: list[dict], info: dict) -> None:
    """Wait until ``daemon`` is healthy (``info["startup_s"]``), then send its untimed warm-up
    requests; raises when it exits, times out or a warm-up request fails."""
    info["startup_s"] = daemon.wait_ready(cfg.startup_timeout_s)
    logger.info("serve %s: up in %.1f s (pid %d)", name, info["startup_s"], daemon.pid)
    if cfg.warmup_requests:
        warm = run_pass(daemon.endpoint, prompts, cfg.warmup_requests, 1, cfg.max_tokens,
                        cfg.request_timeout_s, daemon.is_alive)  # fmt: skip
        if warm.error or any(r.error for r in warm.requests):
            raise RuntimeError(f"warm-up failed: {warm.error or warm.requests[0].error}")
