"""What one load process of ``bench=serve`` runs: its share of the pass's protocol clients (one
``AsyncClient``, i.e. one DEALER socket, each), greedy and streaming, on one asyncio loop.

The pass's shared state (:class:`PassState`: the counted pass's next request index, the timed pass's
first requests still running, its window, the start and the stop signals) lives in shared memory, so
the clients of a pass can be spread over several processes (bench/serve_load.py): at N = 64 one
process parsing every streamed chunk was itself the bottleneck (2026-12-04: a client's round trip
from a finish to its next send had a median of 20-28 ms, against 2 ms at N = 1).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import zmq

from specsched.bench.serve_results import RequestResult
from specsched.client.sync_client import AsyncClient


def stagger_plan(max_tokens: int, concurrency: int) -> list[int]:
    """max_tokens of each client's first request in a timed pass: ceil(max_tokens * (c + 1) / N), so
    the first requests finish spread evenly over one full request (client N-1's is a full one)."""
    return [math.ceil(max_tokens * (c + 1) / concurrency) for c in range(concurrency)]


def client_prompts(client: int, concurrency: int, num_prompts: int, count: int) -> list[int]:
    """The prompt indices of a timed pass's client ``client`` of N: c, c+N, c+2N, ... mod the list."""
    return [(client + j * concurrency) % num_prompts for j in range(count)]


def cycle_length(concurrency: int, num_prompts: int) -> int:
    """How many requests of one client cover its distinct prompts (the period of c + jN mod P)."""
    return num_prompts // math.gcd(concurrency, num_prompts)


class PassState:
    """One pass's state, seen by every load process: multiprocessing shared values (made from ``ctx``,
    a multiprocessing context) handed to the processes when they start, :meth:`reset` before each pass.

    - ``next_index``: a counted pass's next request;
    - ``firsts_left``: a timed pass's clients whose first (staggered) request is still running; the
      one that brings it to 0 opens the window at max(now, t0 + ramp_s) for ``duration_s``;
    - ``t0``: the pass's start (time.perf_counter(), CLOCK_MONOTONIC on Linux: one clock for all
      processes), set with ``go``; ``abort``: stop now (the daemon exited, a process failed).
    """

    def __init__(self, ctx) -> None:
        self._lock = ctx.Lock()
        self._next_index = ctx.RawValue("q", 0)
        self._firsts_left = ctx.RawValue("q", 0)
        self._t0 = ctx.RawValue("d", 0.0)
        self._opens_at = ctx.RawValue("d", math.nan)
        self._closes_at = ctx.RawValue("d", math.inf)
        self._ramp_s = ctx.RawValue("d", 0.0)
        self._duration_s = ctx.RawValue("d", 0.0)
        self.go, self.abort = ctx.Event(), ctx.Event()

    def reset(self, concurrency: int, ramp_s: float, duration_s: float) -> None:
        """Before a pass (no process is running one)."""
        self._next_index.value, self._firsts_left.value = 0, concurrency
        self._t0.value, self._opens_at.value, self._closes_at.value = 0.0, math.nan, math.inf
        self._ramp_s.value, self._duration_s.value = ramp_s, duration_s
        self.go.clear()
        self.abort.clear()

    @property
    def duration_s(self) -> float:
        return self._duration_s.value

    def start(self) -> float:
        """Set t0 to now and let every process go."""
        self._t0.value = time.perf_counter()
        self.go.set()
        return self._t0.value

    @property
    def t0(self) -> float:
        return self._t0.value

    @property
    def opens_at(self) -> float | None:
        v = self._opens_at.value
        return None if math.isnan(v) else v

    @property
    def closes_at(self) -> float:
        return self._closes_at.value

    def take_index(self) -> int:
        """A counted pass's next request index (num_requests or more: none left)."""
        with self._lock:
            i = self._next_index.value
            self._next_index.value = i + 1
            return i

    def first_done(self) -> None:
        """A client's first request is done; the last one opens the window."""
        with self._lock:
            self._firsts_left.value -= 1
            if self._firsts_left.value == 0:
                self._opens_at.value = max(time.perf_counter(), self._t0.value + self._ramp_s.value)
                self._closes_at.value = self._opens_at.value + self._duration_s.value


async def one_request(client: AsyncClient, index: int, prompt: dict, max_tokens: int) -> RequestResult:
    """One streamed greedy request: its tokens, TTFT (send -> first chunk with tokens), one ITL sample
    per token (a chunk's gap to the previous one / its tokens), each chunk's arrival and size."""
    out = RequestResult(index, max_tokens=max_tokens)
    out.sent_wall = time.time()
    t0 = last = out.sent_at = time.perf_counter()
    stream = client.stream(**prompt, max_tokens=max_tokens, temperature=0.0)
    out.request_id = stream.id
    try:
        async for chunk in stream:
            n = len(chunk.token_ids)
            if not n:
                continue
            now = time.perf_counter()
            if out.ttft_s is None:
                out.ttft_s = now - t0
            else:
                out.itl_s += [(now - last) / n] * n
            last = now
            out.token_ids += chunk.token_ids
            out.chunk_at.append(now)
            out.chunk_tokens.append(n)
    except Exception as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        await stream.aclose()
    out.latency_s = time.perf_counter() - t0
    if stream.done is not None:
        out.finish_reason = stream.done.finish_reason
        out.proposed, out.accepted = stream.done.spec.proposed, stream.done.spec.accepted
        out.steps = stream.done.spec.steps
    return out


async def pass_counters(client: AsyncClient) -> tuple[int | None, int | None, dict[str, float] | None]:
    """What a pass reads from the daemon's ``stats`` before and after itself: (``num_compiles_after_start``,
    the engine thread's nonvoluntary context switches so far: its CPU taken by another thread or
    process, its threads' CPU seconds so far with the daemon's uptime, :func:`thread_seconds`); None
    where the daemon does not report one (daemon/host_stats.py)."""
    stats = await client.stats()
    host = getattr(stats, "host", None)
    switches = getattr(host, "engine_nonvoluntary_switches", None)
    return getattr(stats, "num_compiles_after_start", None), switches, thread_seconds(stats)


# the daemon's CPU counters a pass reads (daemon/host_stats.py), by the name its shares are shown under
THREAD_FIELDS = {"engine": "engine_cpu_s", "engine_runqueue": "engine_runqueue_s", "io": "io_cpu_s",
                 "log": "log_cpu_s", "process": "process_cpu_s"}  # fmt: skip


def thread_seconds(stats) -> dict[str, float] | None:
    """The daemon's threads' CPU seconds so far (:data:`THREAD_FIELDS`, those it reports) and its
    ``uptime_s``; None without host counters."""
    host = getattr(stats, "host", None)
    if host is None:
        return None
    got = {name: v for name, f in THREAD_FIELDS.items() if (v := getattr(host, f, None)) is not None}
    return {**got, "uptime_s": stats.uptime_s} if got else None


async def run_clients(
    endpoint: str,
    prompts: list[dict],
    client_ids: list[int],
    concurrency: int,
    state: PassState,
    num_requests: int,
    max_tokens: int,
    timeout_s: float,
    should_stop: Callable[[], bool],
    ready: Callable[[], None] = lambda: None,
    cover: bool = False,
) -> tuple[list[tuple[int, RequestResult]], bool, float]:
    """Clients ``client_ids`` of the pass's ``concurrency``: connect them, call ``ready``, wait for
    ``state.go``, then run them (counted: take request indices until ``num_requests``; timed, when
    ``state.duration_s`` > 0: bench/serve_load.py's closed loop). ``should_stop`` is polled every
    0.25 s. Returns ((request index or -1, result) of every request, stopped early, this process's
    core share while they ran: its CPU seconds, every thread, over the wall seconds; near 1 the load
    generator itself sets the pace, bench/client_load.py)."""
    ctx = zmq.Context()  # one for the process's clients: one ZeroMQ IO thread, not one a client
    clients = [AsyncClient(endpoint, timeout_s=timeout_s, context=ctx) for _ in client_ids]
    results: list[tuple[int, RequestResult]] = []
    try:
        await asyncio.gather(*(c.health() for c in clients))  # connected before the clock starts
        ready()
        await asyncio.get_running_loop().run_in_executor(None, state.go.wait)
        if state.abort.is_set():  # another process failed to start
            return results, True, 0.0
        cpu0, wall0 = time.process_time(), time.perf_counter()

        def core_share() -> float:
            return (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)

        plan = stagger_plan(max_tokens, concurrency)
        period = cycle_length(concurrency, len(prompts))

        # the loops check should_stop themselves too: a cancel can be swallowed inside a request's
        # stream (asyncio.wait_for on Python 3.11 returns the result when its inner wait completes as
        # the cancel arrives), and the loop then ran on to the window's end (CI: a 30 s pass)
        async def counted(c: AsyncClient) -> None:
            while not should_stop() and (i := state.take_index()) < num_requests:
                results.append((i, await one_request(c, i % len(prompts), prompts[i % len(prompts)],
                                                     max_tokens)))  # fmt: skip

        async def timed(ci: int, c: AsyncClient) -> None:
            mine = set(client_prompts(ci, concurrency, len(prompts), period))
            full: set[int] = set()  # prompts this client has sent at full length, without error
            j = 0
            while not should_stop() and (
                time.perf_counter() < state.closes_at or (cover and j <= period and full != mine)
            ):
                p = (ci + j * concurrency) % len(prompts)
                r = await one_request(c, p, prompts[p], plan[ci] if j == 0 else max_tokens)
                r.client, r.seq, r.staggered = ci, j, r.max_tokens < max_tokens
                results.append((-1, r))
                if r.error is None and not r.staggered:
                    full.add(p)
                if j == 0:
                    state.first_done()
                j += 1

        async def watchdog() -> None:
            while not should_stop():
                await asyncio.sleep(0.25)

        if state.duration_s:
            coros = [timed(ci, c) for ci, c in zip(client_ids, clients)]
        else:
            coros = [counted(c) for c in clients]
        work = asyncio.ensure_future(asyncio.gather(*coros))
        guard = asyncio.ensure_future(watchdog())
        await asyncio.wait([work, guard], return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # told to stop (the daemon exited)
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return results, True, core_share()
        guard.cancel()
        work.result()
        return results, False, core_share()
    finally:
        for c in clients:
            await c.close()
        ctx.term()
