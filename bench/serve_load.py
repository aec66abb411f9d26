"""The load generator of ``bench=serve``: N concurrent protocol clients (one ``AsyncClient``, i.e. one
DEALER socket, each); greedy, streaming.

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

Per request: the token ids, TTFT (send -> first chunk with tokens) and the inter-token latencies, one
sample per token: the gap between a chunk and the previous one divided by the chunk's tokens (a chunk
of 4 accepted tokens 10 ms after the previous one gives four samples of 2.5 ms).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from specsched.bench.serve_results import PassResult, RequestResult
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


async def _one(client: AsyncClient, index: int, prompt: dict, max_tokens: int) -> RequestResult:
    out = RequestResult(index, max_tokens=max_tokens)
    t0 = last = out.sent_at = time.perf_counter()
    stream = client.stream(**prompt, max_tokens=max_tokens, temperature=0.0)
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


async def _compiles(client: AsyncClient) -> int | None:
    """The daemon's ``stats`` field ``num_compiles_after_start`` (None from a daemon too old to have it)."""
    return getattr(await client.stats(), "num_compiles_after_start", None)


async def _drive(
    endpoint: str,
    prompts: list[dict],
    num_requests: int,
    concurrency: int,
    max_tokens: int,
    timeout_s: float,
    is_alive: Callable[[], bool],
    duration_s: float = 0.0,
    ramp_s: float = 0.0,
    cover: bool = False,
) -> PassResult:
    clients = [AsyncClient(endpoint, timeout_s=timeout_s) for _ in range(concurrency)]
    try:
        await asyncio.gather(*(c.health() for c in clients))  # connected before the clock starts
        before = await _compiles(clients[0])
        results: list[RequestResult | None] = [] if duration_s else [None] * num_requests
        next_index = 0
        t0 = time.perf_counter()
        window = {"opens_at": None, "closes_at": float("inf")}
        firsts_left = concurrency
        plan = stagger_plan(max_tokens, concurrency)
        period = cycle_length(concurrency, len(prompts))

        async def counted(c: AsyncClient) -> None:
            nonlocal next_index
            while next_index < num_requests:
                i, next_index = next_index, next_index + 1  # one event loop: no lock needed
                results[i] = await _one(c, i % len(prompts), prompts[i % len(prompts)], max_tokens)

        async def timed(ci: int, c: AsyncClient) -> None:
            nonlocal firsts_left
            mine = set(client_prompts(ci, concurrency, len(prompts), period))
            full: set[int] = set()  # prompts this client has sent at full length, without error
            j = 0
            while time.perf_counter() < window["closes_at"] or (cover and j <= period and full != mine):
                p = (ci + j * concurrency) % len(prompts)
                r = await _one(c, p, prompts[p], plan[ci] if j == 0 else max_tokens)
                r.client, r.seq, r.staggered = ci, j, r.max_tokens < max_tokens
                results.append(r)
                if r.error is None and not r.staggered:
                    full.add(p)
                if j == 0:
                    firsts_left -= 1
                    if not firsts_left:  # every first request is done: the ramp is over
                        window["opens_at"] = max(time.perf_counter(), t0 + ramp_s)
                        window["closes_at"] = window["opens_at"] + duration_s
                j += 1

        async def watchdog() -> None:
            while is_alive():
                await asyncio.sleep(0.25)

        if duration_s:
            coros = [timed(i, c) for i, c in enumerate(clients)]
        else:
            coros = [counted(c) for c in clients]
        work = asyncio.ensure_future(asyncio.gather(*coros))
        guard = asyncio.ensure_future(watchdog())
        await asyncio.wait([work, guard], return_when=asyncio.FIRST_COMPLETED)
        wall = time.perf_counter() - t0
        if not work.done():  # the daemon exited mid-pass
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            done = [r for r in results if r is not None]
            return PassResult(wall, done, before, None, "the daemon exited during the pass")
        guard.cancel()
        work.result()
        after = await _compiles(clients[0])
        done = [r for r in results if r is not None]
        if not duration_s:
            return PassResult(wall, done, before, after, max_tokens=max_tokens)
        lo, hi = window["opens_at"], window["closes_at"]
        for r in done:
            r.num_tokens_in_window = r.tokens_between(lo, hi)
        return PassResult(wall, done, before, after, window_s=duration_s, ramp_s=lo - t0, opens_at=lo,
                          closes_at=hi, max_tokens=max_tokens, concurrency=concurrency)  # fmt: skip
    finally:
        for c in clients:
            await c.close()


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
) -> PassResult:
    """One pass from ``concurrency`` clients at once: ``num_requests`` requests over ``prompts`` (request
    i takes prompt i mod len), or (``duration_s`` > 0) a timed closed loop with a staggered start, a
    ramp (until every client's first request is done, at least ``ramp_s``) and a window of
    ``duration_s`` (the module's docstring); ``cover``: each client then goes on until it has sent every
    prompt of its sequence at full length. ``is_alive`` is polled: a daemon that exits ends the pass."""
    if concurrency < 1 or num_requests < 1 or not prompts or duration_s < 0 or ramp_s < 0:
        raise ValueError(f"need concurrency >= 1, num_requests >= 1, prompts, duration_s and ramp_s >= 0; "
                         f"got {concurrency}, {num_requests}, {len(prompts)} prompts, {duration_s}, "
                         f"{ramp_s}")  # fmt: skip
    coro = _drive(endpoint, prompts, num_requests, concurrency, max_tokens, timeout_s, is_alive, duration_s,
                  ramp_s, cover)  # fmt: skip
    return asyncio.run(coro)
