"""Fixtures that run the real daemon as a subprocess on a free loopback port.

``start_daemon(**options)`` launches ``python -c LAUNCHER`` (a real engine + ``Server.serve_forever``)
and waits until it answers ``health``; ``start_cli_daemon(*overrides)`` launches ``specsched-serve``
itself (``python -m specsched.daemon``, hydra config); every daemon started is stopped at the end of
the session. ``tiny_daemon`` (preset ``tiny``, no tokenizer) and ``text_daemon`` (a tiny HF checkpoint
with a byte-level BPE tokenizer and a chat template) are shared by the whole session.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import pytest
import zmq

from specsched.daemon.auth import CurveKeys, KeyPair, public_key_path, read_public_key

# The daemon process: engine from the JSON spec in argv[1], optional decision log, serve until a signal.
LAUNCHER = """
import json, logging, sys
import torch
torch.set_num_threads(1)
from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.daemon.server import DaemonConfig, Server
spec = json.loads(sys.argv[1])
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
cfg = EngineConfig(model=ModelConfig(**spec["model"]), cache=CacheConfig(**spec["cache"]),
                   scheduler=SchedulerConfig(**spec["scheduler"]), spec=SpecConfig(**spec["spec"]))
engine = Engine.from_config(cfg)
log = None
if spec["log_path"]:
    from specsched.daemon.log import LogConfig, LogWriter
    log = LogWriter(LogConfig(**{"flush_interval_s": 0.1, **spec["log"], "path": spec["log_path"]}))
    log.start_run(spec, model=cfg.model.source, device="cpu", version="test")
Server(engine, DaemonConfig(**spec["daemon"]), log).serve_forever()
print("specsched test daemon: clean exit", flush=True)
"""

DEFAULT_DAEMON = dict(
    max_message_bytes=64 * 1024,
    max_prompt_tokens=512,
    max_inflight_per_client=16,
    shutdown_grace_s=0.0,
    linger_ms=500,
    idle_sleep_ms=20.0,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DaemonProcess:
    endpoint: str
    proc: subprocess.Popen
    output_path: Path
    log_path: Path | None
    options: dict = field(default_factory=dict)
    curve: CurveKeys | None = None  # the keys of an allowed client (CURVE daemons)

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        """The daemon's resident memory, read from /proc (psutil is not installed)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send ``sig`` and wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(
                f"daemon did not exit within {timeout_s} s after signal {sig}:\n{self.output()}"
            ) from None


def _curve_keys(d: DaemonProcess, client: KeyPair, deadline: float) -> CurveKeys:
    """The client's keys for a CURVE daemon, once it has written (generated) its public key."""
    public = public_key_path(d.options["daemon"]["curve_key_file"])
    while not public.exists():
        if d.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"daemon wrote no public key {public}:\n{d.output()}")
        time.sleep(0.05)
    return CurveKeys(read_public_key(public), client.public, client.secret)


def _wait_ready(d: DaemonProcess, timeout_s: float, curve_client: KeyPair | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    if curve_client is not None:
        d.curve = _curve_keys(d, curve_client, deadline)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if d.curve is not None:
        d.curve.apply(sock)
    sock.connect(d.endpoint)
    try:
        while time.monotonic() < deadline:
            if d.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {d.proc.returncode} at start:\n{d.output()}")
            sock.send(msgpack.packb({"v": 1, "type": "health"}))
            if sock.poll(250):
                assert msgpack.unpackb(sock.recv())["type"] == "health_reply"
                return
        raise AssertionError(f"daemon not ready within {timeout_s} s:\n{d.output()}")
    finally:
        sock.close()


def launch(
    tmp_dir: Path,
    *,
    model: dict | None = None,
    num_blocks: int = 256,
    daemon: dict | None = None,
    log_db: bool = False,
    max_num_seqs: int = 64,
    scheduler: dict | None = None,
    log: dict | None = None,
    log_path: Path | None = None,
    endpoint: str | None = None,
    curve_client: KeyPair | None = None,
) -> DaemonProcess:
    """Start a daemon. ``log_path`` (implies a log) lets a restart append to the same file,
    ``endpoint`` lets it take the same port; ``curve_client``: an allowed client's key pair (the
    daemon's config names the key files), used to wait for it and stored as ``DaemonProcess.curve``."""
    endpoint = endpoint or f"tcp://127.0.0.1:{free_port()}"
    if log_db and log_path is None:
        log_path = tmp_dir / "log.sqlite"
    spec = {
        "model": {
            "source": "tiny",
            "dtype": "float32",
            "device": "cpu",
            "attn_backend": "torch",
            **(model or {}),
        },
        "cache": {"block_size": 16, "num_blocks": num_blocks},
        "scheduler": {"max_num_seqs": max_num_seqs, **(scheduler or {})},
        "spec": {"proposer": "ngram", "max_k": 4},
        "daemon": {**DEFAULT_DAEMON, **(daemon or {}), "endpoint": endpoint},
        "log_path": str(log_path) if log_path is not None else None,
        "log": log or {},
    }
    out = tmp_dir / "daemon.out"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, json.dumps(spec)], stdout=f, stderr=subprocess.STDOUT, env=env
        )
    d = DaemonProcess(endpoint, proc, out, log_path, spec)
    try:
        _wait_ready(d, timeout_s=180.0, curve_client=curve_client)
    except BaseException:
        proc.kill()
        raise
    return d


def launch_cli(
    tmp_dir: Path, *overrides: str, endpoint: str | None = None, curve_client: KeyPair | None = None
) -> DaemonProcess:
    """``python -m specsched.daemon model=tiny ... *overrides`` (the real ``specsched-serve``), in
    ``tmp_dir``; the options recorded are the ``daemon.*`` overrides."""
    endpoint = endpoint or f"tcp://127.0.0.1:{free_port()}"
    args = ["model=tiny", "model.device=cpu", "cache.num_blocks=64", f"daemon.endpoint={endpoint}"]
    args += overrides
    pairs = [a.split("=", 1) for a in args]
    daemon = {k[len("daemon.") :]: v for k, v in pairs if k.startswith("daemon.")}
    out = tmp_dir / "daemon.out"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specsched.daemon", *args],
            cwd=tmp_dir,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
        )
    log_path = next((tmp_dir / a.split("=", 1)[1] for a in args if a.startswith("log.path=")), None)
    d = DaemonProcess(endpoint, proc, out, log_path, {"daemon": daemon, "args": args})
    try:
        _wait_ready(d, timeout_s=180.0, curve_client=curve_client)
    except BaseException:
        proc.kill()
        raise
    return d


@pytest.fixture(scope="session")
def start_daemon(tmp_path_factory):
    """``start_daemon(**launch_options) -> DaemonProcess``; all are stopped at session end."""
    yield from _starter(lambda **options: launch(tmp_path_factory.mktemp("daemon"), **options))


@pytest.fixture(scope="session")
def start_cli_daemon(tmp_path_factory):
    """``start_cli_daemon(*overrides, **launch_cli_options) -> DaemonProcess``; stopped at session end."""
    yield from _starter(lambda *a, **kw: launch_cli(tmp_path_factory.mktemp("cli-daemon"), *a, **kw))


def _starter(launcher):
    started: list[DaemonProcess] = []

    def start(*args, **options) -> DaemonProcess:
        d = launcher(*args, **options)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(10)


@pytest.fixture(scope="session")
def tiny_daemon(start_daemon) -> DaemonProcess:
    return start_daemon()


@pytest.fixture(scope="session")
def text_daemon(start_daemon, tiny_hf_dir, tmp_path_factory) -> DaemonProcess:
    cache = tmp_path_factory.mktemp("model-cache")
    return start_daemon(model={"source": str(tiny_hf_dir), "cache_dir": str(cache)})


@pytest.fixture
def raw_socket(tiny_daemon):
    """A DEALER socket connected to the shared tiny daemon."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tiny_daemon.endpoint)
    yield sock
    sock.close()


@pytest.fixture
def stream_vs_generate():
    """``check(endpoint, prompts, max_tokens)``: every prompt through its own client at once, generated
    and then streamed; asserts each stream's tokens are its generate's and its done counts them, and
    that every generate ran to ``max_tokens``."""
    from specsched.client.sync_client import AsyncClient

    def check(endpoint: str, prompts: list[list[int]], max_tokens: int = 10) -> None:
        async def one(prompt: list[int]) -> tuple[list[int], list[int]]:
            async with AsyncClient(endpoint, timeout_s=60) as c:
                want = (await c.generate(prompt_ids=prompt, max_tokens=max_tokens)).token_ids
                s = c.stream(prompt_ids=prompt, max_tokens=max_tokens)
                got = [t async for ch in s for t in ch.token_ids]
                assert s.done.usage.completion_tokens == len(got)
                return want, got

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts))

        for want, got in asyncio.run(main()):
            assert len(want) == max_tokens and got == want

    return check
