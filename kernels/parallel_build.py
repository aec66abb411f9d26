"""Compile Triton attention variants in parallel worker processes before the start-up warm-up.

A cold start compiles every attention launch config of the serving domain (59 for SmolLM2 at the
default limits, ~1 s each on the H200's host, one after the other: most of a cold start). Triton's
compile holds the GIL for most of its passes, so threads do not help; processes do. Each worker is
``python -m specsched.kernels.parallel_build`` with its share of the configs as JSON on stdin: it
launches each once on a dummy two-block KV cache of the model's shape and dtype (the variant depends
on the config, the dtype and the cache's strides, not on the batch), which writes the compiled kernel
to Triton's on-disk cache (``TRITON_CACHE_DIR``, inherited). The parent's own warm-up that follows
launches the same configs and loads each from disk instead of compiling it.

A complete build leaves a marker file in the cache dir (``specsched-prebuilt/<key>.json``, the key
hashing the configs, the cache shape, the GPU, the torch and Triton versions and the attention
kernel's source), so a warm start skips the workers (their start-up alone is seconds). Nothing here
is required for correctness: a worker that fails or times out is logged and the
parent's serial warm-up compiles what it left. Worker protocol (stdout, one line each):
``ok <index>`` per config launched, then ``done <seconds>``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheShape:
    """What an attention variant depends on besides its launch config."""

    num_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name: "bfloat16", "float16", "float32"
    device: str = "cuda"  # "cuda", "cuda:1", or "cpu" (under TRITON_INTERPRET=1)
    pdl: bool = False  # the kernels' launch mode (kernels/pdl.py): another variant
    pdl_trigger_first: bool = False  # ... and its trigger's place (PdlMode.trigger == "before")

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"CacheShape.dtype must be bfloat16|float16|float32, got {self.dtype!r}")
        for name in ("num_heads", "kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"CacheShape.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ParallelBuildReport:
    num_configs: int = 0  # configs handed to the workers
    num_launched: int = 0  # configs the workers reported launched (compiled or loaded from disk)
    num_workers: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)  # one line per worker that failed
    is_cached: bool = False  # a marker says an earlier start built these already: no workers ran

    @property
    def is_complete(self) -> bool:
        return self.num_launched == self.num_configs and not self.failures


def shard(items: list, num_workers: int) -> list[list]:
    """Round-robin ``items`` over at most ``num_workers`` non-empty shards (keeps the expensive
    configs of one kind, which the enumeration lists together, spread over the workers)."""
    n = max(1, min(num_workers, len(items)))
    return [items[i::n] for i in range(n)] if items else []


def _cache_dir(env: dict[str, str]) -> Path:
    return Path(env.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def marker_path(configs: list, shape: CacheShape, env: dict[str, str]) -> Path:
    """Where a complete build of ``configs`` for ``shape`` is recorded (see module)."""
    import torch
    import triton

    from specsched.kernels import triton_attention, triton_attention_kernels

    try:
        gpu = torch.cuda.get_device_name(shape.device) if shape.device.startswith("cuda") else "cpu"
    except (AssertionError, RuntimeError):  # no CUDA here: the workers will say so
        gpu = shape.device
    # the wrappers and the kernels: a change to either is a new build
    source = b"".join(Path(m.__file__).read_bytes() for m in (triton_attention, triton_attention_kernels))
    key = json.dumps([sorted(repr(c) for c in configs), asdict(shape), gpu, torch.__version__,
                      triton.__version__, hashlib.sha256(source).hexdigest()])  # fmt: skip
    return _cache_dir(env) / "specsched-prebuilt" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def build_in_workers(
    configs: list,  # [LaunchConfig]
    shape: CacheShape,
    num_workers: int,
    progress: Callable[[int], None] | None = None,  # called with 1 per config launched
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,  # worker environment (default: this process's)
) -> ParallelBuildReport:
    """Launch ``configs`` in ``num_workers`` worker processes; returns when all have exited."""
    report = ParallelBuildReport(num_configs=len(configs))
    env = env if env is not None else dict(os.environ)
    marker = marker_path(list(configs), shape, env)
    if marker.exists():
        report.is_cached, report.num_launched = True, len(configs)
        return report
    shards = shard(list(configs), num_workers)
    report.num_workers = len(shards)
    if not shards:
        return report
    t0 = time.perf_counter()
    lock = threading.Lock()
    procs, readers = [], []
    for i, part in enumerate(shards):
        proc = subprocess.Popen(
            [sys.executable, "-m", "specsched.kernels.parallel_build"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env,
        )  # fmt: skip
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"shape": asdict(shape), "configs": [asdict(c) for c in part]}))
        proc.stdin.close()
        stderr: list[str] = []
        procs.append((i, proc, stderr))
        readers.append(
            threading.Thread(target=_read, args=(proc, stderr, report, lock, progress), daemon=True)
        )
        readers[-1].start()
    deadline, timed_out = time.monotonic() + timeout_s, set()
    for i, proc, _ in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out.add(i)
            report.failures.append(f"worker {i}: timed out after {timeout_s:.0f} s")
    for t in readers:
        t.join(timeout=5.0)
    for i, proc, stderr in procs:
        if proc.returncode != 0 and i not in timed_out:
            tail = "".join(stderr).strip().splitlines()[-3:]
            report.failures.append(f"worker {i}: exit {proc.returncode}: {' | '.join(tail) or 'no stderr'}")
    report.seconds = time.perf_counter() - t0
    if report.is_complete:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"configs": len(configs), "shape": asdict(shape), "at": time.time()}))
    for line in report.failures:
        logger.warning("parallel kernel build: %s (the serial warm-up builds what it left)", line)
    return report


def _read(proc: subprocess.Popen, stderr: list[str], report: ParallelBuildReport, lock, progress) -> None:
    err = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
    err.start()
    for line in proc.stdout:
        if line.startswith("ok "):
            with lock:
                report.num_launched += 1
            if progress is not None:
                progress(1)
    err.join(timeout=5.0)


def _worker(spec: dict) -> None:
    """Worker side: launch every config of ``spec`` once; one ``ok <i>`` line each."""
    import torch

    from specsched.kernels.attention_config import LaunchConfig
    from specsched.kernels.attention_variants import warm_up_attention
    from specsched.kernels.pdl import PdlMode, set_pdl

    shape = CacheShape(**spec["shape"])
    set_pdl(PdlMode(on=shape.pdl, trigger="before" if shape.pdl_trigger_first else "after"))
    configs = [LaunchConfig(**c) for c in spec["configs"]]
    dev = torch.device(shape.device)
    dims = (2, shape.block_size, shape.kv_heads, shape.head_dim)  # as LlamaForCausalLM.allocate_kv_cache
    k_cache = torch.zeros(dims, dtype=getattr(torch, shape.dtype), device=dev)
    v_cache = torch.zeros_like(k_cache)
    t0 = time.perf_counter()
    for i, cfg in enumerate(configs):
        warm_up_attention([cfg], k_cache, v_cache, shape.num_heads, shape.head_dim**-0.5)
        print(f"ok {i}", flush=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    print(f"done {time.perf_counter() - t0:.3f}", flush=True)


if __name__ == "__main__":
    _worker(json.loads(sys.stdin.read()))
