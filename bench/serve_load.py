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
from dataclasses import dataclass, field, replace

import numpy as np

from specsched.client.sync_client import AsyncClient


@dataclass
class RequestResult:
    prompt_index: int
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one per token after the first chunk's
    num_tokens_in_window: int = 0  # tokens that arrived inside the pass's window (timed passes)
    latency_s: float = 0.0
    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    finish_reason: str | None = None
    error: str | None = None
    max_tokens: int = 0  # as sent
    staggered: bool = False  # a timed pass's first request of a client, cut short (max_tokens < full)
    client: int = 0  # which client sent it, and its number among that client's requests (timed passes)
    seq: int = 0
    sent_at: float = 0.0  # time.perf_counter() at the send
    chunk_at: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # and its token count

    def in_window(self, opens_at: float, closes_at: float) -> bool:
        """Sent inside the window."""
        return opens_at <= self.sent_at < closes_at

    def sent_in(self, windows: list[tuple[float, float]]) -> bool:
        """Sent inside one of ``windows`` ([opens_at, closes_at) each)."""
        return any(lo <= self.sent_at < hi for lo, hi in windows)

    def busy_in(self, opens_at: float, closes_at: float) -> float:
        """Seconds of [opens_at, closes_at] between its send and its last chunk (or its end)."""
        end = self.sent_at + self.latency_s
        return max(0.0, min(end, closes_at) - max(self.sent_at, opens_at))

    def tokens_between(self, opens_at: float, closes_at: float) -> int:
        return self.tokens_in([(opens_at, closes_at)])

    def tokens_in(self, windows: list[tuple[float, float]]) -> int:
        """Tokens that arrived inside one of ``windows`` ([opens_at, closes_at] each)."""
        return sum(n for t, n in zip(self.chunk_at, self.chunk_tokens) if _inside(t, windows))

    def itl_between(self, opens_at: float, closes_at: float) -> list[float]:
        """The ITL samples of the tokens that arrived inside [opens_at, closes_at]."""
        return self.itl_in([(opens_at, closes_at)])

    def itl_in(self, windows: list[tuple[float, float]]) -> list[float]:
        """The ITL samples of the tokens that arrived inside one of ``windows``."""
        out: list[float] = []
        for k in range(1, len(self.chunk_at)):
            t, n = self.chunk_at[k], self.chunk_tokens[k]
            if _inside(t, windows):
                out += [(t - self.chunk_at[k - 1]) / n] * n
        return out


def _inside(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(lo <= t <= hi for lo, hi in windows)


@dataclass
class PassResult:
    wall_s: float
    requests: list[RequestResult]
    compiles_before: int | None = None  # the daemon's num_compiles_after_start before / after the pass
    compiles_after: int | None = None
    error: str | None = None  # the pass itself failed (the daemon exited, ...)
    window_s: float | None = None  # a timed pass's window (tok/s = tokens in it / window_s)
    ramp_s: float | None = None  # a timed pass: first send -> the window's opening
    opens_at: float | None = None  # a timed pass's window, time.perf_counter()
    closes_at: float | None = None
    max_tokens: int | None = None  # the full max_tokens of the pass
    # interleaved passes (split_interleaved): this pass holds its share of the loop's requests; tok/s
    # is then concurrency x tokens in the window / their busy time in it
    is_request_split: bool = False
    concurrency: int = 0  # clients of the loop

    @property
    def windows(self) -> list[tuple[float, float]]:
        """What this pass counts: its one window [opens_at, closes_at]."""
        return [(self.opens_at, self.closes_at)]

    @property
    def compiles(self) -> int | None:
        if self.compiles_before is None or self.compiles_after is None:
            return None
        return self.compiles_after - self.compiles_before

    @property
    def timed(self) -> bool:
        return self.opens_at is not None and self.closes_at is not None and bool(self.window_s)


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


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


def summarize(res: PassResult) -> dict:
    """A pass's table cells: output tok/s, TTFT/ITL p50/p99 in ms, acceptance. Timed passes: tok/s over
    the window; TTFT, acceptance and tok/step from the requests sent inside it, ITL from its tokens."""
    ok = [r for r in res.requests if r.error is None]
    tokens = sum(len(r.token_ids) for r in res.requests)
    if res.timed:
        windows = res.windows
        in_window = sum(r.tokens_in(windows) for r in res.requests)
        if res.is_request_split:
            busy = sum(r.busy_in(res.opens_at, res.closes_at) for r in res.requests)
            rate = res.concurrency * in_window / busy if busy > 0 else float("nan")
        else:
            rate = in_window / res.window_s
        sent = [r for r in res.requests if r.sent_in(windows)]
        picked = [r for r in sent if r.error is None]
        itl = [x * 1e3 for r in ok for x in r.itl_in(windows)]
    else:
        rate = tokens / res.wall_s if res.wall_s > 0 else float("nan")
        sent, picked = res.requests, ok
        itl = [x * 1e3 for r in ok for x in r.itl_s]
    ttft = [r.ttft_s * 1e3 for r in picked if r.ttft_s is not None]
    proposed, accepted = sum(r.proposed for r in picked), sum(r.accepted for r in picked)
    steps = sum(r.steps for r in picked)
    errors = [r.error for r in res.requests if r.error is not None]
    return {
        "num_requests": len(res.requests),
        "requests_in_window": len(sent) if res.timed else None,
        "num_errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": tokens,
        "wall_s": res.wall_s,
        "tokens_per_s": rate,
        "window_s": res.window_s,
        "ramp_s": res.ramp_s,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "acceptance": accepted / proposed if proposed else None,
        "tokens_per_step": sum(len(r.token_ids) for r in picked) / steps if steps else None,
        "compiles": res.compiles,
        "error": res.error,
    }


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


def pass_of(seq: int, period: int, passes: int) -> int:
    """The pass (0-based) of a client's request number ``seq`` in an interleaved loop: consecutive
    requests alternate between the passes, and each cycle of ``period`` requests (the client's prompt
    sequence, :func:`cycle_length`) starts one pass later than the one before, so over ``passes``
    cycles every prompt of the client lands once in each pass (with alternation alone, an even
    period would give each pass half the prompts, always the same half)."""
    return (seq % period + seq // period) % passes


def split_interleaved(
    res: PassResult, passes: int, period: int, slice_s: float
) -> tuple[list[PassResult], list[float]]:
    """One timed loop's requests dealt to ``passes`` interleaved passes (:func:`pass_of` of each
    request's number; ``period``: the clients' prompt cycle), which see the same host (a machine whose
    speed drifts over seconds slows both alike), the same daemon state and the same prompts. A pass's
    tok/s is N x its tokens inside the window / its requests' busy time inside it (in a closed loop
    the N clients are busy all the window: the passes together give the loop's tok/s). Returns the
    passes and the loop's tok/s in slices of ``slice_s`` seconds, in time order (what one short pass
    would have measured: the host's drift, shown beside the passes).

    Passes by time slice (slice j to pass j mod passes) were tried first: a client's prompt cycle
    whose length is near an even number of slices gives one pass the same prompts every time, and
    on the H200 (2026-12-04) that alone made the passes of one loop differ by up to 26%."""
    if not res.timed or passes < 1 or slice_s <= 0 or period < 1:
        raise ValueError(f"need a timed pass, passes >= 1, period >= 1 and slice_s > 0; got {passes}, "
                         f"{period}, {slice_s}")  # fmt: skip
    num = int(res.window_s / slice_s + 1e-9)
    slices = [(res.opens_at + j * slice_s, res.opens_at + (j + 1) * slice_s) for j in range(num)]
    rates = [sum(r.tokens_in([w]) for r in res.requests) / slice_s for w in slices]
    out = [
        replace(res, requests=[r for r in res.requests if pass_of(r.seq, period, passes) == p],
                is_request_split=True)
        for p in range(passes)
    ]  # fmt: skip
    return out, rates


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
