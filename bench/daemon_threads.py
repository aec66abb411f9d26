"""The daemon's threads under streaming load, per chunk (CPU): how much the IO and log threads cost.

Starts ``specsched-serve model=tiny`` (a real subprocess on loopback, a real SQLite decision log
unless ``--no-log``), keeps ``S`` streams busy from one :class:`~specsched.client.AsyncClient` for
``--seconds`` (each stream sends its next request when one ends), and reads the daemon's ``stats``
before and after: the engine, IO and log-writer threads' CPU seconds (``host``, /proc ``schedstat``;
daemon/host_stats.py) over the chunks streamed and over the wall time. The IO thread's CPU per chunk
is what N = 64 on a GPU multiplies (~13,000 chunks a second at 4-5 ms steps), beside one interpreter
lock with the engine thread.

    python -m specsched.bench.daemon_threads [--streams 1 8 32] [--seconds 10] [--no-log]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from specsched.bench.markdown import emit, fmt, table
from specsched.bench.serve_daemon import Daemon
from specsched.client.sync_client import AsyncClient, Client


async def stream_load(endpoint: str, streams: int, seconds: float) -> int:
    """``streams`` streams of 64-token greedy requests on one client for ``seconds``; chunks received."""
    num_chunks = 0
    stop_at = time.monotonic() + seconds

    async def one(i: int, client: AsyncClient) -> None:
        nonlocal num_chunks
        j = 0
        while time.monotonic() < stop_at:
            prompt = [(7 * i + j + t) % 200 + 3 for t in range(12)]
            async for _ in client.stream(prompt_ids=prompt, max_tokens=64):
                num_chunks += 1
            j += 1

    async with AsyncClient(endpoint, timeout_s=120) as c:
        await asyncio.gather(*(one(i, c) for i in range(streams)))
    return num_chunks


def measure(streams: int, seconds: float, log_dir: Path, is_logged: bool = True) -> dict:
    """One daemon (its output and, with ``is_logged``, its SQLite log in ``log_dir``), ``streams``
    streams: chunks/s and each thread's CPU per chunk and share of the wall."""
    log = [f"log.path={log_dir / f'threads_{streams}.sqlite'}"] if is_logged else ["log=none"]
    overrides = ["model=tiny", "model.device=cpu", "model.dtype=float32", "cache.num_blocks=512", *log]
    daemon = Daemon(overrides, log_dir / f"threads_{streams}.log", {})
    try:
        daemon.wait_ready(120)
        with Client(daemon.endpoint, timeout_s=60) as c:
            before = c.stats()
        num_chunks = asyncio.run(stream_load(daemon.endpoint, streams, seconds))
        with Client(daemon.endpoint, timeout_s=60) as c:
            after = c.stats()
    finally:
        daemon.stop(30)
    a, b = before.host, after.host
    if a is None or b is None or b.io_cpu_s is None:
        raise SystemExit(f"the daemon reports no thread counters here (Linux /proc); see {daemon.log_file}")
    wall = after.uptime_s - before.uptime_s

    def delta(name: str) -> float | None:
        x, y = getattr(a, name), getattr(b, name)
        return None if x is None or y is None else y - x

    row = {"streams": streams, "chunks_per_s": num_chunks / wall, "wall_s": wall}
    for key, name in (("engine", "engine_cpu_s"), ("io", "io_cpu_s"), ("log", "log_cpu_s"),
                      ("process", "process_cpu_s")):  # fmt: skip
        d = delta(name)
        row[f"{key}_share"] = None if d is None else d / wall
        row[f"{key}_us"] = None if d is None else 1e6 * d / max(num_chunks, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--no-log", action="store_true", help="serve without the decision log")
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or min(args.streams) < 1:
        ap.error("--seconds must be > 0 and every --streams >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(s, args.seconds, Path(tmp), not args.no_log) for s in args.streams]
    header = ["streams", "chunks/s", "IO µs a chunk", "log µs a chunk", "engine µs a chunk",
              "IO / log / engine / process share of the wall"]  # fmt: skip
    shares = ("io", "log", "engine", "process")
    body = [[str(r["streams"]), fmt(r["chunks_per_s"], 0), fmt(r["io_us"], 1), fmt(r["log_us"], 1),
             fmt(r["engine_us"], 1), " / ".join(fmt(r[f"{k}_share"]) for k in shares)]
            for r in rows]  # fmt: skip
    emit(f"the daemon's threads (CPU, tiny model, {args.seconds} s a run, "
         f"{'no log' if args.no_log else 'SQLite log'})\n\n{table(header, body)}\n", args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
