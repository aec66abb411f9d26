"""What a pass of ``bench=serve`` measured (:class:`RequestResult`, :class:`PassResult`) and its table
cells (:func:`summarize`, :func:`summarize_many`); interleaved passes (:func:`split_interleaved`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np


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
    sent_wall: float = 0.0  # time.time() at the send: the daemon's log clock (bench/serve_requests.py)
    request_id: str | None = None  # the Generate message's id (the daemon logs "<client hex>:<id>")
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
    # the daemon's engine thread's nonvoluntary context switches before / after the pass (its CPU taken
    # by another thread or process: daemon/host_stats.py); None where the daemon does not report them
    switches_before: int | None = None
    switches_after: int | None = None
    # each load process's core share while its clients ran (CPU s / wall s; bench/serve_clients.py)
    load_shares: list[float] = field(default_factory=list)
    # the daemon's threads' CPU seconds and uptime before / after the pass (bench/serve_clients.py
    # thread_seconds); None where the daemon does not report them
    threads_before: dict[str, float] | None = None
    threads_after: dict[str, float] | None = None

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
    def engine_switches(self) -> int | None:
        """The engine thread's nonvoluntary context switches during the pass (its ramp and drain too)."""
        if self.switches_before is None or self.switches_after is None:
            return None
        return self.switches_after - self.switches_before

    @property
    def thread_shares(self) -> dict[str, float] | None:
        """Each daemon thread's CPU seconds during the pass (its ramp and drain too) over the daemon's
        uptime across it: 1.0 is a thread busy throughout (``engine_runqueue``: runnable, no CPU)."""
        a, b = self.threads_before, self.threads_after
        if not a or not b or b.get("uptime_s", 0.0) <= a.get("uptime_s", 0.0):
            return None
        wall = b["uptime_s"] - a["uptime_s"]
        return {k: (b[k] - a[k]) / wall for k in b if k != "uptime_s" and k in a}

    @property
    def load_share(self) -> float | None:
        """The busiest load process's core share during the pass (near 1: the clients set the pace)."""
        return max(self.load_shares) if self.load_shares else None

    @property
    def timed(self) -> bool:
        return self.opens_at is not None and self.closes_at is not None and bool(self.window_s)


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(res: PassResult) -> dict:
    """A pass's table cells: output tok/s, TTFT/ITL p50/p99 in ms, acceptance. Timed passes: tok/s over
    the window; TTFT, acceptance and tok/step from the requests sent inside it, ITL from its tokens."""
    return summarize_many([res])


def summarize_many(parts: list[PassResult]) -> dict:
    """The cells of one pass made of ``parts`` (the same pass's share of several timed loops, e.g. of
    every round in rounds mode): tok/s over all of them (dealt passes: N x their tokens in the windows
    / their requests' busy time there; else tokens in the windows / the windows' total length),
    percentiles over the pooled samples, counts summed."""
    if not parts:
        raise ValueError("summarize_many needs at least one part")
    every = [r for p in parts for r in p.requests]
    ok = [r for r in every if r.error is None]
    tokens = sum(len(r.token_ids) for r in every)
    timed = all(p.timed for p in parts)
    sent, picked, itl, in_window, busy = [], [], [], 0, 0.0
    mix: dict[int, list[float]] = {}  # dealt passes: prompt -> [tokens in the windows, busy s / N]
    if timed:
        for p in parts:
            windows = p.windows
            in_window += sum(r.tokens_in(windows) for r in p.requests)
            if p.is_request_split:
                busy += sum(r.busy_in(p.opens_at, p.closes_at) for r in p.requests) / p.concurrency
                for r in p.requests:
                    m = mix.setdefault(r.prompt_index, [0, 0.0])
                    m[0] += r.tokens_in(windows)
                    m[1] += r.busy_in(p.opens_at, p.closes_at) / p.concurrency
            mine = [r for r in p.requests if r.sent_in(windows)]
            sent += mine
            picked += [r for r in mine if r.error is None]
            itl += [x * 1e3 for r in p.requests if r.error is None for x in r.itl_in(windows)]
        if all(p.is_request_split for p in parts):
            rate = in_window / busy if busy > 0 else float("nan")
        else:
            rate = in_window / sum(p.window_s for p in parts)
    else:
        wall = sum(p.wall_s for p in parts)
        rate = tokens / wall if wall > 0 else float("nan")
        sent, picked = every, ok
        itl = [x * 1e3 for r in ok for x in r.itl_s]
    ttft = [r.ttft_s * 1e3 for r in picked if r.ttft_s is not None]
    proposed, accepted = sum(r.proposed for r in picked), sum(r.accepted for r in picked)
    steps = sum(r.steps for r in picked)
    errors = [r.error for r in every if r.error is not None]
    compiles = [p.compiles for p in parts]
    ramps = [p.ramp_s for p in parts if p.ramp_s is not None]
    return {
        "num_requests": len(every),
        "requests_in_window": len(sent) if timed else None,
        "num_errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": tokens,
        "wall_s": sum(p.wall_s for p in parts),
        "tokens_per_s": rate,
        "window_s": sum(p.window_s for p in parts) if timed else None,
        "ramp_s": sum(ramps) / len(ramps) if ramps else None,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "acceptance": accepted / proposed if proposed else None,
        "tokens_per_step": sum(len(r.token_ids) for r in picked) / steps if steps else None,
        "compiles": None if any(c is None for c in compiles) else sum(compiles),
        "error": next((p.error for p in parts if p.error), None),
        "prompt_mix": mix if timed and all(p.is_request_split for p in parts) else None,
    }


def same_mix_rates(mixes: list[dict[int, list[float]]]) -> list[float] | None:
    """Each pass's tok/s for one and the same prompt mix (direct standardization): dealt passes hold
    different requests, and at N = 1 a 2 x 1 s window x 3 rounds holds ~25 per pass, so one pass can
    get more of the prompts the n-gram proposer drafts well (H200, 2026-12-04 11:51: acceptance 0.16
    in one pass of goodput at N = 1, 0.20 in the other; 9 % apart in tok/s, non-speculative 0.7 %).
    ``mixes[i]``: pass i's prompt -> [tokens in its windows, busy seconds / N] (``prompt_mix`` of
    :func:`summarize_many`). Over the prompts every pass has tokens of, with W_p = their tokens in
    all passes together: rate_i = sum_p W_p / sum_p W_p * busy_ip / tokens_ip, the tok/s pass i would
    have had serving the pooled mix at its own per-prompt speed. None when no prompt is in every pass."""
    common = set.intersection(*(set(k for k, v in m.items() if v[0] > 0 and v[1] > 0) for m in mixes))
    if not mixes or not common:
        return None
    weight = {p: sum(m[p][0] for m in mixes) for p in common}
    total = sum(weight.values())
    return [total / sum(weight[p] * m[p][1] / m[p][0] for p in common) for m in mixes]


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
