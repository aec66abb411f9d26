"""The load generator of ``bench=serve``: N concurrent protocol clients (one ``AsyncClient``, i.e. one
DEALER socket, each) take requests from one shared list until all are done; greedy, streaming.

A pass is either ``num_requests`` requests (tok/s over its wall time) or, with ``duration_s``, a closed
loop of that many seconds: each client sends its next request as soon as its last one is done, and
tok/s counts only the tokens that arrived inside the window (no ramp-down tail of a few stragglers
at a lower batch, which dominates short passes); requests still running at its end finish outside it.

Per request: the token ids, TTFT (send -> first chunk with tokens) and the inter-token latencies, one
sample per token: the gap between a chunk and the previous one divided by the chunk's tokens (a chunk
of 4 accepted tokens 10 ms after the previous one gives four samples of 2.5 ms).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specsched.client.sync_client import AsyncClient


@dataclass
class RequestResult:
    prompt_index: int
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one per token after the first chunk's
    num_tokens_in_window: int = 0  # tokens that arrived before the pass's window closed
    latency_s: float = 0.0
    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class PassResult:
    wall_s: float
    requests: list[RequestResult]
    compiles_before: int | None = None  # the daemon's num_compiles_after_start before / after the pass
    compiles_after: int | None = None
    error: str | None = None  # the pass itself failed (the daemon exited, ...)
    window_s: float | None = None  # a timed pass's window (tok/s = tokens in it / window_s)

    @property
    def compiles(self) -> int | None:
        if self.compiles_before is None or self.compiles_after is None:
            return None
        return self.compiles_after - self.compiles_before


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(res: PassResult) -> dict:
    """A pass's table cells: output tok/s over its wall time, TTFT/ITL p50/p99 in ms, acceptance."""
    ok = [r for r in res.requests if r.error is None]
    tokens = sum(len(r.token_ids) for r in res.requests)
    if res.window_s:
        rate = sum(r.num_tokens_in_window for r in res.requests) / res.window_s
    else:
        rate = tokens / res.wall_s if res.wall_s > 0 else float("nan")
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    itl = [x * 1e3 for r in ok for x in r.itl_s]
    proposed, accepted = sum(r.proposed for r in ok), sum(r.accepted for r in ok)
    steps = sum(r.steps for r in ok)
    errors = [r.error for r in res.requests if r.error is not None]
    return {
        "num_requests": len(res.requests),
        "num_errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": tokens,
        "wall_s": res.wall_s,
        "tokens_per_s": rate,
        "window_s": res.window_s,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "acceptance": accepted / proposed if proposed else None,
        "tokens_per_step": sum(len(r.token_ids) for r in ok) / steps if steps else None,
        "compiles": res.compiles,
        "error": res.error,
    }


async def _one(
    client: AsyncClient, index: int, prompt: dict, max_tokens: int, closes_at: float = float("inf")
) -> RequestResult:
    out = RequestResult(index)
    t0 = last = time.perf_counter()
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
            if now <= closes_at:
                out.num_tokens_in_window += n
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
) -> PassResult:
    clients = [AsyncClient(endpoint, timeout_s=timeout_s) for _ in range(concurrency)]
    try:
        await asyncio.gather(*(c.health() for c in clients))  # connected before the clock starts
        before = await _compiles(clients[0])
        results: list[RequestResult | None] = [] if duration_s else [None] * num_requests
        next_index = 0
        closes_at = float("inf")

        def more() -> bool:
            return time.perf_counter() < closes_at if duration_s else next_index < num_requests

        async def worker(c: AsyncClient) -> None:
            nonlocal next_index
            while more():
                i, next_index = next_index, next_index + 1  # one event loop: no lock needed
                if duration_s:
                    results.append(None)
                results[i] = await _one(c, i % len(prompts), prompts[i % len(prompts)], max_tokens, closes_at)

        async def watchdog() -> None:
            while is_alive():
                await asyncio.sleep(0.25)

        t0 = time.perf_counter()
        if duration_s:
            closes_at = t0 + duration_s
        work = asyncio.ensure_future(asyncio.gather(*(worker(c) for c in clients)))
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
        window = duration_s or None
        return PassResult(wall, [r for r in results if r is not None], before, after, window_s=window)
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
) -> PassResult:
    """One pass: ``num_requests`` requests over ``prompts`` (request i takes prompt i mod len), from
    ``concurrency`` clients at once, or (``duration_s`` > 0) a closed loop for that many seconds.
    ``is_alive`` is polled: a daemon that exits ends the pass."""
    if concurrency < 1 or num_requests < 1 or not prompts:
        raise ValueError(f"need concurrency >= 1, num_requests >= 1 and prompts; got {concurrency}, "
                         f"{num_requests}, {len(prompts)} prompts")  # fmt: skip
    coro = _drive(endpoint, prompts, num_requests, concurrency, max_tokens, timeout_s, is_alive, duration_s)
    return asyncio.run(coro)
