"""Daemon + protocol overhead on CPU: requests/s and p50/p99 per-request overhead (issue 3).

Starts ``specsched-serve model=tiny`` on a free loopback port (a real subprocess, real sockets, a
real SQLite log), then:
- latency: N sequential one-token requests through the client library; the per-request overhead is
  the client round trip minus the engine's own time for the same request, measured in-process on
  an identical engine (prefill + first token);
- throughput: M one-token requests from C concurrent asyncio clients, requests/s.

    python -m specsched.bench.daemon_overhead [--n 300] [--m 1000] [--clients 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

from specsched.bench.loopback import free_port, pct
from specsched.client.sync_client import AsyncClient, Client
from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.request import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def engine_ms(n: int) -> list[float]:
    """In-process time of the same one-token request (prefill + sample) on the same engine config."""
    import torch

    torch.set_num_threads(1)
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(num_blocks=4096),
        spec=SpecConfig(proposer="ngram"),
        policy={"name": "fixed", "k": 0, "scorer": "mqa"},
    )
    engine = Engine(cfg)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        engine.generate([PROMPT], SamplingParams(max_tokens=1))
        out.append((time.perf_counter() - t) * 1e3)
    return out


async def flood(endpoint: str, m: int, clients: int) -> float:
    cs = [AsyncClient(endpoint, timeout_s=120) for _ in range(clients)]

    async def worker(c: AsyncClient, n: int) -> None:
        for _ in range(n):
            await c.generate(prompt_ids=PROMPT, max_tokens=1)

    t = time.perf_counter()
    await asyncio.gather(*(worker(c, m // clients) for c in cs))
    dt = time.perf_counter() - t
    for c in cs:
        await c.close()
    return (m // clients) * clients / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="sequential requests (latency)")
    ap.add_argument("--m", type=int, default=1000, help="concurrent requests (throughput)")
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    tmp = tempfile.mkdtemp()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specsched.daemon",
            "model=tiny",
            "policy=fixed",
            "policy.k=0",
            f"daemon.endpoint={endpoint}",
            f"log.path={tmp}/run.sqlite",
            "cache.num_blocks=4096",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(f"{tmp}/daemon.log", "w"),  # noqa: SIM115
    )
    try:
        with Client(endpoint, timeout_s=2) as c:
            for _ in range(100):
                try:
                    c.health()
                    break
                except Exception:
                    time.sleep(0.2)
            for _ in range(20):  # warm-up
                c.generate(prompt_ids=PROMPT, max_tokens=1)
            lat = []
            for _ in range(args.n):
                t = time.perf_counter()
                c.generate(prompt_ids=PROMPT, max_tokens=1)
                lat.append((time.perf_counter() - t) * 1e3)
        rps = asyncio.run(flood(endpoint, args.m, args.clients))
    finally:
        proc.terminate()
        proc.wait(30)
    eng = engine_ms(args.n)
    base = statistics.median(eng)
    over = [x - base for x in lat]
    print(f"round trip ms: p50 {pct(lat, 0.5):.2f}  p99 {pct(lat, 0.99):.2f}")
    print(f"engine alone ms (in-process, same request): p50 {base:.2f}  p99 {pct(eng, 0.99):.2f}")
    print(f"daemon+protocol overhead ms: p50 {pct(over, 0.5):.2f}  p99 {pct(over, 0.99):.2f}")
    print(f"throughput: {rps:.0f} requests/s ({args.m} one-token requests, {args.clients} clients)")


if __name__ == "__main__":
    main()
