"""The load generator of ``bench=serve``: N concurrent protocol clients, greedy, streaming, spread over
``procs`` processes (bench/serve_clients.py runs one process's share on one asyncio loop).

A pass is either

- counted (``duration_s`` = 0): ``num_requests`` requests taken from one shared list (request i takes
  prompt i mod the list) until all are done; tok/s = output tokens / the pass's wall time; or
- timed (``duration_s`` > 0): a closed loop measuring the steady state. Client c of N sends prompts c,
  c+N, c+2N, ... (mod the list), each as soon as its last request is done, so both passes send the
  same sequence per client. **Staggered start**: client c's first request has max_tokens
  ceil(max_tokens * (c + 1) / N), every later one the full max_tokens, so the first requests finish
  spread evenly over one request's length and the loop stays de-synchronized (no waves of N requests
  that prefill, decode and finish together). **Ramp**: the window opens when every client's first
  request is done (and not before ``ramp_s`` after the first send); it lasts ``duration_s``; tok/s
  counts only the tokens that arrived inside it. Requests still running at its end finish outside it.
  TTFT and the per-request columns come from the requests sent inside the window, ITL from the tokens
  that arrived inside it. ``cover``: after the window, each client goes on until it has sent one
  full-length request for every prompt of its sequence (the baseline's pass 1: the references).

**Processes**: with ``procs`` > 1 the clients are dealt to that many spawned processes (client c to
process c mod procs), which share the pass's state (:class:`PassState`) and one clock; the pass starts
when every process has connected its clients. A process holding fewer clients parses fewer chunks per
step: one process for all 64 clients made the load generator, not the daemon, set the batch.

Per request: the token ids, TTFT (send -> first chunk with tokens) and the inter-token latencies, one
sample per token: the gap between a chunk and the previous one divided by the chunk's tokens (a chunk
of 4 accepted tokens 10 ms after the previous one gives four samples of 2.5 ms).
"""

from __future__ import annotations

import asyncio
import atexit
import math
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

from specsched.bench.serve_clients import (
    PassState,
    client_prompts,
    cycle_length,
    pass_counters,
    run_clients,
    stagger_plan,
)
from specsched.bench.serve_results import PassResult, RequestResult
from specsched.client.sync_client import AsyncClient

__all__ = ["client_prompts", "cycle_length", "load_procs", "run_pass", "stagger_plan"]

_START_TIMEOUT_S = 120.0  # a load process connecting its clients


def load_procs(concurrency: int, clients_per_proc: int) -> int:
    """How many load processes for ``concurrency`` clients: ceil(N / clients_per_proc), at most this
    process's cores; 1 (this process) when ``clients_per_proc`` is 0."""
    if clients_per_proc < 0:
        raise ValueError(f"clients_per_proc must be >= 0 (0: all in one process), got {clients_per_proc}")
    if not clients_per_proc:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(math.ceil(concurrency / clients_per_proc), cores))


async def _stats_counters(endpoint: str, timeout_s: float) -> tuple[int | None, int | None, dict | None]:
    async with AsyncClient(endpoint, timeout_s=timeout_s) as c:
        return await pass_counters(c)


def _worker(conn, state: PassState) -> None:
    """A load process: runs the passes it is sent (its clients' share) until told to stop; answers
    "ready" once its clients are connected, then ("ok", requests, stopped early, core share) or
    ("error", text, None)."""
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if cmd is None:
            return
        endpoint, prompts, ids, concurrency, num_requests, max_tokens, timeout_s, cover = cmd
        try:
            coro = run_clients(endpoint, prompts, ids, concurrency, state, num_requests, max_tokens,
                               timeout_s, state.abort.is_set, lambda: conn.send("ready"), cover)  # fmt: skip
            conn.send(("ok", *asyncio.run(coro)))
        except BaseException:
            conn.send(("error", traceback.format_exc()[-2000:], None))


class LoadProcesses:
    """``procs`` spawned load processes kept for many passes (each start costs 1-2 s: an interpreter
    that imports the caller's main module, torch with it), and their shared :class:`PassState`."""

    def __init__(self, procs: int) -> None:
        ctx = mp.get_context("spawn")  # no fork of the caller's threads and sockets
        self.state = PassState(ctx)
        self._conns, self._procs = [], []
        for _ in range(procs):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(theirs, self.state), daemon=True)
            p.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(p)

    @property
    def size(self) -> int:
        return len(self._procs)

    @property
    def is_healthy(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, procs: int, endpoint: str, prompts: list[dict], concurrency: int, num_requests: int,
            max_tokens: int, timeout_s: float, is_alive: Callable[[], bool],
            cover: bool) -> tuple[list[tuple[int, RequestResult]], str | None, list[float]]:  # fmt: skip
        """One pass (``state`` reset by the caller) on the first ``procs`` processes, client c on process
        c mod procs; t0 once all have connected. (requests, error, each process's core share)."""
        conns, state = self._conns[:procs], self.state
        for w, c in enumerate(conns):
            ids = list(range(w, concurrency, procs))
            c.send((endpoint, prompts, ids, concurrency, num_requests, max_tokens, timeout_s, cover))
        results: list[tuple[int, RequestResult]] = []
        shares: list[float] = []
        error, waiting, pending = None, set(conns), set(conns)
        try:
            while pending:
                got = wait(list(pending), timeout=_START_TIMEOUT_S if waiting else 0.25)
                if waiting and not got:
                    raise RuntimeError(f"load processes did not connect in {_START_TIMEOUT_S:.0f} s")
                for c in got:
                    msg = c.recv()
                    if msg == "ready":
                        waiting.discard(c)
                        if not waiting:
                            state.start()  # every process connected: the clock starts
                        continue
                    pending.discard(c)
                    waiting.discard(c)
                    if msg[0] == "error":
                        error = error or f"load process: {msg[1]}"
                        state.abort.set()
                        state.go.set()  # the others, still waiting to start, stop
                        continue
                    results += msg[1]
                    shares.append(msg[3])
                    if msg[2]:
                        error = error or "the daemon exited during the pass"
                if pending and not waiting and not is_alive() and not state.abort.is_set():
                    state.abort.set()
                    error = error or "the daemon exited during the pass"
        except BaseException:
            self.close()
            raise
        return results, error, shares

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        self._conns, self._procs = [], []


_kept: LoadProcesses | None = None  # kept between passes; closed at exit


def _load_processes(procs: int) -> LoadProcesses:
    """The kept load processes, at least ``procs`` of them (grown, or started over when one died)."""
    global _kept
    if _kept is None or _kept.size < procs or not _kept.is_healthy:
        close_load_processes()
        _kept = LoadProcesses(procs)
    return _kept


def close_load_processes() -> None:
    """Stop the kept load processes (run_pass starts them again when needed)."""
    global _kept
    if _kept is not None:
        _kept.close()
        _kept = None


atexit.register(close_load_processes)


def run_pass(
    endpoint: str,
    prompts: list[dict],
    num_requests: int,
    concurrency: int,
    max_tokens: int,
    timeout_s: float,
    is_alive: Callable[[], bool] = lambda: True,
    duration_s: float = 0.0,
    ramp_s: float = 0.0,
    cover: bool = False,
    procs: int = 1,
) -> PassResult:
    """One pass from ``concurrency`` clients at once: ``num_requests`` requests over ``prompts`` (request
    i takes prompt i mod len), or (``duration_s`` > 0) a timed closed loop with a staggered start, a
    ramp (until every client's first request is done, at least ``ramp_s``) and a window of
    ``duration_s`` (the module's docstring); ``cover``: each client then goes on until it has sent every
    prompt of its sequence at full length. ``procs``: the clients spread over that many processes (1:
    this one). ``is_alive`` is polled: a daemon that exits ends the pass."""
    if concurrency < 1 or num_requests < 1 or not prompts or duration_s < 0 or ramp_s < 0 or procs < 1:
        raise ValueError(f"need concurrency >= 1, num_requests >= 1, prompts, duration_s and ramp_s >= 0, "
                         f"procs >= 1; got {concurrency}, {num_requests}, {len(prompts)} prompts, "
                         f"{duration_s}, {ramp_s}, {procs}")  # fmt: skip
    procs = min(procs, concurrency)
    before, switches_before, threads_before = asyncio.run(_stats_counters(endpoint, timeout_s))
    if procs == 1:
        state = PassState(mp.get_context("spawn"))
        state.reset(concurrency, ramp_s, duration_s)
        coro = run_clients(endpoint, prompts, list(range(concurrency)), concurrency, state, num_requests,
                           max_tokens, timeout_s, lambda: not is_alive(), state.start, cover)  # fmt: skip
        got, stopped, share = asyncio.run(coro)
        error, shares = "the daemon exited during the pass" if stopped else None, [share]
    else:
        pool = _load_processes(procs)
        state = pool.state
        state.reset(concurrency, ramp_s, duration_s)
        got, error, shares = pool.run(procs, endpoint, prompts, concurrency, num_requests, max_tokens,
                                      timeout_s, is_alive, cover)  # fmt: skip
    wall = time.perf_counter() - state.t0 if state.t0 else 0.0  # t0 0: it failed before the start
    if duration_s:
        done = [r for _, r in got]
    else:
        done = [r for _, r in sorted(got, key=lambda x: x[0])]
    if error:
        return PassResult(wall, done, before, None, error, load_shares=shares)
    after, switches_after, threads_after = asyncio.run(_stats_counters(endpoint, timeout_s))
    switches = {"switches_before": switches_before, "switches_after": switches_after, "load_shares": shares,
                "threads_before": threads_before, "threads_after": threads_after}  # fmt: skip
    if not duration_s:
        return PassResult(wall, done, before, after, max_tokens=max_tokens, **switches)
    lo, hi = state.opens_at, state.closes_at
    for r in done:
        r.num_tokens_in_window = r.tokens_between(lo, hi)
    return PassResult(wall, done, before, after, window_s=duration_s, ramp_s=lo - state.t0, opens_at=lo,
                      closes_at=hi, max_tokens=max_tokens, concurrency=concurrency, **switches)  # fmt: skip
