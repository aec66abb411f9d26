"""What a durable decision log costs (issue 15): ``log.durable=true`` vs ``false`` on the tiny model.

Starts ``specsched-serve model=tiny`` (a real subprocess, loopback, a real SQLite log in WAL mode) once
per mode and round, drives ``--clients`` concurrent asyncio clients that each stream requests back to
back for ``--seconds``, and prints per mode:
- done after last chunk: the time from a request's last chunk to its ``done`` at the client (the
  commit wait: durable mode holds the ``done`` until the request's row is committed);
- round trip: from sending ``generate`` to its ``done``;
- throughput: requests and tokens per second of all clients together.
Modes alternate over ``--rounds`` rounds (the order flips each round) so that drift on a shared
machine hits both alike.

    python -m specsched.bench.log_durability [--clients 50] [--seconds 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from specsched.bench.loopback import free_port, pct
from specsched.client.sync_client import AsyncClient, Client


@dataclass
class Result:
    done_gap_ms: list[float] = field(default_factory=list)  # last chunk -> done, one per request
    round_trip_ms: list[float] = field(default_factory=list)
    num_tokens: int = 0
    seconds: float = 0.0


def start(tmp: str, durable: bool, extra: list[str]) -> tuple[subprocess.Popen, str]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    args = ["model=tiny", "model.device=cpu", "cache.num_blocks=4096", f"daemon.endpoint={endpoint}"]
    args += [f"log.path={tmp}/durable-{durable}.sqlite", f"log.durable={str(durable).lower()}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(f"{tmp}/daemon-{durable}.log", "a") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specsched.daemon", *args], env=env, stdout=subprocess.DEVNULL, stderr=err
        )
    with Client(endpoint, timeout_s=2) as c:
        deadline = time.monotonic() + 180
        while True:
            try:
                c.health()
                break
            except Exception:  # noqa: BLE001 -- not up yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon did not start; see {tmp}/daemon-{durable}.log") from None
                time.sleep(0.2)
        for i in range(10):  # warm-up
            c.generate(prompt_ids=[5, 6, 7, 8 + i], max_tokens=8)
    return proc, endpoint


async def drive(endpoint: str, num_clients: int, seconds: float, max_tokens: int) -> Result:
    res = Result()
    stop_at = time.perf_counter() + seconds

    async def client(k: int) -> None:
        async with AsyncClient(endpoint, timeout_s=120) as c:
            j = 0
            while time.perf_counter() < stop_at:
                prompt = [3 + k % 40, 4, 5, 6 + j % 7, 3 + k % 40, 4]
                t0 = last = time.perf_counter()
                async for chunk in c.stream(prompt_ids=prompt, max_tokens=max_tokens):
                    last = time.perf_counter()
                    res.num_tokens += len(chunk.token_ids)
                t1 = time.perf_counter()
                res.done_gap_ms.append((t1 - last) * 1e3)
                res.round_trip_ms.append((t1 - t0) * 1e3)
                j += 1

    t = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(num_clients)))
    res.seconds = time.perf_counter() - t
    return res


def describe(durable: bool, r: Result) -> str:
    n = len(r.round_trip_ms)
    return (
        f"log.durable={str(durable).lower():5}  done after last chunk ms: p50 {pct(r.done_gap_ms, 0.5):6.2f} "
        f"p99 {pct(r.done_gap_ms, 0.99):6.2f} | round trip ms: p50 {pct(r.round_trip_ms, 0.5):7.1f} "
        f"p99 {pct(r.round_trip_ms, 0.99):7.1f} | {n / r.seconds:6.1f} requests/s, "
        f"{r.num_tokens / r.seconds:7.0f} tokens/s ({n} requests in {r.seconds:.1f} s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=10.0, help="traffic per mode and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("overrides", nargs="*", help="more hydra overrides for the daemon, e.g. policy=fixed")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="specsched-durability-")
    results: dict[bool, Result] = {True: Result(), False: Result()}
    for rnd in range(args.rounds):
        for durable in (True, False) if rnd % 2 == 0 else (False, True):
            proc, endpoint = start(tmp, durable, args.overrides)
            try:
                r = asyncio.run(drive(endpoint, args.clients, args.seconds, args.max_tokens))
            finally:
                proc.terminate()
                proc.wait(60)
            print(f"round {rnd + 1}: {describe(durable, r)}", flush=True)
            total = results[durable]
            total.done_gap_ms += r.done_gap_ms
            total.round_trip_ms += r.round_trip_ms
            total.num_tokens += r.num_tokens
            total.seconds += r.seconds
    print(f"all rounds, {args.clients} clients, max_tokens {args.max_tokens}:")
    for durable in (True, False):
        print("  " + describe(durable, results[durable]))
    on, off = results[True], results[False]
    p50, p99 = (pct(on.done_gap_ms, q) - pct(off.done_gap_ms, q) for q in (0.5, 0.99))
    rps = (len(on.round_trip_ms) / on.seconds) / (len(off.round_trip_ms) / off.seconds) - 1
    print(f"  durable adds: done after last chunk p50 {p50:+.2f} ms, p99 {p99:+.2f} ms; req/s {rps:+.1%}")


if __name__ == "__main__":
    main()
