"""What a load process of ``bench=serve`` spends per streamed chunk, and how late the chunks reach it (CPU).

At N = 64 a client's next request reached the H100's daemon 48-65 ms after its last one finished there,
against 3-10 ms at N = 1-16 (docs/benchmarks.md, eleventh session), and the passes' spread was worst
there: the load generator is one suspect. This measures it without a model: a scripted daemon (a
ROUTER in its own process that answers each ``generate`` with one chunk per stream every ``--step-ms``,
as a decoding step does, and a ``done`` after ``--tokens``; each chunk's text is its send time) and
``--procs`` load processes of ``--clients`` :class:`~specsched.client.AsyncClient` each (one DEALER
socket a client, as bench/serve_clients.py runs them; ``--one-socket``: one client with that many
streams, as the gateway runs), each client streaming request after request for ``--seconds``; the
clients of a process share one ZeroMQ context (``--context-each``: one each, as before 2026-12-08).

Per load process: chunks/s, CPU µs per chunk (its process time, every thread, over the chunks), the
share of one core that is, and each chunk's latency from the scripted daemon's send to its client's
receipt (p50 / p99). Repeats alternate the socket layouts when both are asked (``--layouts``).

    python -m specsched.bench.client_load [--procs 1] [--clients 8] [--step-ms 5] [--tokens 128]
        [--seconds 5] [--repeats 3] [--layouts per-client one-socket]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

import zmq

from specsched.bench.loopback import free_port, pct
from specsched.bench.markdown import emit, fmt, table
from specsched.daemon.io_thread import encode_reply
from specsched.daemon.protocol import Chunk, Done, Generate, SpecUsage, Usage, decode, encode

LAYOUTS = ("per-client", "one-socket")


def scripted_daemon(endpoint: str, step_ms: float, tokens: int, seconds: float) -> None:
    """A process: every ``step_ms`` one chunk to each open stream (text = its send time, time.time()),
    a ``done`` after ``tokens`` chunks; new generates are taken between steps."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    sent: dict[tuple[bytes, str], int] = {}  # (client, request id) -> chunks sent
    end, next_step = time.monotonic() + seconds, time.perf_counter()
    while time.monotonic() < end:
        while sock.poll(0):
            client, frame = sock.recv_multipart()
            msg = decode(frame)
            if isinstance(msg, Generate):
                sent[(client, msg.id)] = 0
        for (client, rid), n in list(sent.items()):
            sock.send_multipart([client, encode_reply(Chunk(rid, [5], repr(time.time()), 0, 0))])
            if n + 1 < tokens:
                sent[(client, rid)] = n + 1
            else:
                done = Done(rid, "length", Usage(3, n + 1), SpecUsage(0, 0, n + 1))
                sock.send_multipart([client, encode(done)])
                del sent[(client, rid)]
        next_step += step_ms / 1e3
        if (pause := next_step - time.perf_counter()) > 0:
            time.sleep(pause)
    sock.close(0)
    ctx.term()


def load_process(endpoint: str, clients: int, is_one_socket: bool, seconds: float, out,
                 is_shared_context: bool = True) -> None:  # fmt: skip
    """A process: ``clients`` streams, each sending its next request when one ends, for ``seconds``;
    puts (chunks, CPU seconds, wall seconds, latencies) on ``out`` (each stream's last request ends
    after ``seconds``: the wall is the time to its end). ``is_shared_context``: the clients open their
    sockets in one ZeroMQ context (as bench/serve_clients.py does), else each in its own."""
    from specsched.client.sync_client import AsyncClient

    latencies: list[float] = []
    stop_at = time.time() + seconds

    async def stream_until_stop(client: AsyncClient) -> None:
        while time.time() < stop_at:
            async for chunk in client.stream(prompt_ids=[1, 2, 3], max_tokens=1_000_000):
                latencies.append(time.time() - float(chunk.text))

    ctx = zmq.Context() if is_shared_context else None

    async def main() -> None:
        made = [
            AsyncClient(endpoint, timeout_s=30, context=ctx) for _ in range(1 if is_one_socket else clients)
        ]
        per_stream = made * clients if is_one_socket else made
        try:
            await asyncio.wait_for(asyncio.gather(*map(stream_until_stop, per_stream)), seconds + 10)
        except asyncio.TimeoutError:
            pass  # the scripted daemon stopped with streams open: what arrived counts
        for c in made:
            await c.close()

    cpu0, wall0 = time.process_time(), time.perf_counter()
    try:
        asyncio.run(main())
    except Exception as e:  # noqa: BLE001 -- the parent reports it instead of waiting
        out.put(("failed", repr(e), 0.0, []))
        return
    finally:
        if ctx is not None:
            ctx.term()
    out.put((len(latencies), time.process_time() - cpu0, time.perf_counter() - wall0, latencies))


def measure(procs: int, clients: int, step_ms: float, tokens: int, seconds: float, layout: str,
            is_shared_context: bool = True) -> list[dict]:  # fmt: skip
    """One run: a scripted daemon and ``procs`` load processes; one row per load process."""
    ctx = mp.get_context("spawn")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = ctx.Process(target=scripted_daemon, args=(endpoint, step_ms, tokens, seconds + 5))
    daemon.start()
    out = ctx.Queue()
    loads = [ctx.Process(target=load_process,
                         args=(endpoint, clients, layout == "one-socket", seconds, out, is_shared_context))
             for _ in range(procs)]  # fmt: skip
    for p in loads:
        p.start()
    got = [out.get(timeout=seconds + 60) for _ in loads]
    if failed := [why for num, why, _, _ in got if num == "failed"]:
        raise RuntimeError(f"a load process failed: {failed[0]}")
    for p in loads:
        p.join()
    daemon.terminate()
    daemon.join()
    rows = []
    for num, cpu_s, wall_s, lat in got:
        lat.sort()
        rows.append({"layout": layout, "chunks_per_s": num / wall_s, "cpu_us": 1e6 * cpu_s / max(num, 1),
                     "core_share": cpu_s / wall_s, "p50_ms": 1e3 * pct(lat, 0.5),
                     "p99_ms": 1e3 * pct(lat, 0.99)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=1, help="load processes")
    ap.add_argument("--clients", type=int, default=8, help="streams a load process keeps open")
    ap.add_argument("--step-ms", type=float, default=5.0, help="the scripted daemon's step")
    ap.add_argument("--tokens", type=int, default=128, help="chunks a request")
    ap.add_argument("--seconds", type=float, default=5.0, help="each run's length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--context-each", action="store_true",
                    help="each client in a ZeroMQ context of its own (default: one a process)")  # fmt: skip
    args = ap.parse_args(argv)
    if min(args.procs, args.clients, args.tokens, args.repeats) < 1 or args.step_ms <= 0 or args.seconds <= 0:
        ap.error("--procs, --clients, --tokens, --repeats must be >= 1; --step-ms and --seconds > 0")
    rows = []
    for r in range(args.repeats):
        order = args.layouts if r % 2 == 0 else args.layouts[::-1]
        for layout in order:
            got = measure(args.procs, args.clients, args.step_ms, args.tokens, args.seconds, layout,
                          not args.context_each)  # fmt: skip
            rows += [{"repeat": r + 1, "proc": i + 1, **row} for i, row in enumerate(got)]
    header = ["layout", "repeat", "process", "chunks/s", "CPU µs a chunk", "core share", "latency p50 ms",
              "p99 ms"]  # fmt: skip
    body = [[r["layout"], str(r["repeat"]), str(r["proc"]), fmt(r["chunks_per_s"], 0), fmt(r["cpu_us"], 1),
             fmt(r["core_share"], 2), fmt(r["p50_ms"], 2), fmt(r["p99_ms"], 2)]
            for r in sorted(rows, key=lambda r: (r["layout"], r["repeat"], r["proc"]))]  # fmt: skip
    contexts = "a ZeroMQ context a client" if args.context_each else "one ZeroMQ context a process"
    head = (f"load process per streamed chunk: {args.procs} process(es) x {args.clients} streams, a chunk "
            f"per stream every {args.step_ms} ms, {args.seconds} s a run, {contexts}")  # fmt: skip
    emit(f"{head}\n\n{table(header, body)}\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
