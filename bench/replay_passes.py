"""A serving log cut into passes (issue 13's replay fidelity): each set of closed-loop clients that
kept the daemon busy, with its requests, steps, bits and each client's round trip, so each pass can
be replayed at its own concurrency (bench/replay_fidelity.py).

A log mixes concurrencies: ``bench=serve`` drives a daemon with N closed-loop clients per pass.
Replaying the whole log with ``scheduler.max_num_seqs`` would batch requests of an N = 1 pass 64 at a
time, so :func:`split_passes` cuts it into busy periods of the daemon (from the ``requests`` rows'
arrival and finish times), merged while they share a client, and :func:`sub_run` cuts out each
pass's part of the run.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from specsched.policies.replay_bits import MatchBits
from specsched.policies.replay_log import RecordedRun


@dataclass
class RequestTimes:
    key: str  # as RecordedRequest.key: the request id, "#n" appended for its n-th reuse
    client: str | None
    arrival: float
    finish: float


@dataclass
class Pass:
    """Requests served by one set of closed-loop clients, with no idle gap to another set."""

    concurrency: int
    keys: list[str]
    clients: set
    start: float
    end: float
    segments: list[int] = dataclasses.field(default_factory=list)  # per key: its busy period in the pass


def request_times(path: str, run_id: int) -> list[RequestTimes]:
    """The run's ``requests`` rows in arrival order, keyed as :func:`load_run` keys them."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "select request_id, client, arrival, finish_time from requests where run_id = ? order by arrival",
            [run_id],
        ).fetchall()
    finally:
        db.close()
    seen: dict[str, int] = {}
    out = []
    for rid, client, arrival, finish in rows:
        n = seen[rid] = seen.get(rid, 0) + 1
        out.append(RequestTimes(rid if n == 1 else f"{rid}#{n}", client, arrival or 0.0, finish or 0.0))
    return out


def split_passes(requests: Sequence[RequestTimes], max_num_seqs: int) -> list[Pass]:
    """Busy periods (a request arriving after every earlier one finished starts one), merged with the
    previous pass while they share a client; concurrency = its distinct clients (capped at
    ``max_num_seqs``), or ``max_num_seqs`` when the log names no client. A pass keeps its periods
    (``segments``): the replay drains the batch between them as the live daemon did (``bench=serve``
    runs a config's rounds at one N back to back: each ends when its last request does, and at N = 64
    the batch fell from 64 to 2 there, 40 requests per step on average against 56 in a replay that
    filled every slot at once: +10-13 % tok/s)."""
    periods: list[list[RequestTimes]] = []
    busy_until = float("-inf")
    for r in sorted(requests, key=lambda r: r.arrival):
        if not periods or r.arrival > busy_until:
            periods.append([])
        periods[-1].append(r)
        busy_until = max(busy_until, r.finish)
    passes: list[Pass] = []
    for period in periods:
        clients = {r.client for r in period}
        if passes and clients & passes[-1].clients:
            last = passes[-1]
            last.keys += [r.key for r in period]
            last.segments += [last.segments[-1] + 1] * len(period)
            last.clients |= clients
            last.end = max(last.end, *(r.finish for r in period))
        else:
            passes.append(Pass(0, [r.key for r in period], clients, period[0].arrival,
                               max(r.finish for r in period), [0] * len(period)))  # fmt: skip
    for p in passes:
        p.concurrency = max_num_seqs if None in p.clients else min(len(p.clients), max_num_seqs)
    return passes


class PassPart(NamedTuple):
    """What :func:`sub_run` cuts out of a log for one pass."""

    p: Pass
    run: RecordedRun  # the pass's requests (arrival order) and steps, max_num_seqs = its concurrency
    bits: MatchBits
    segments: list[int]  # per request: its busy period in the pass (``Pass.segments``)
    think_ms: list[float]  # per request: ms from its client's last request's finish to its arrival
    # per busy period: the ms of its live steps (total_ms, prefills included) from its first arrival
    # to its last, the time its clients were sending (policies/replay.py simulate's ``window_ms``)
    window_ms: list[float]


def sub_run(run: RecordedRun, bits: MatchBits, p: Pass, times: Sequence[RequestTimes]) -> PassPart:
    """The part of ``run`` that served pass ``p`` (its requests in arrival order, their decode steps,
    the prefill steps inside its time window), with ``max_num_seqs`` = its concurrency, those
    requests' bits, each one's busy period in the pass, and its client's round trip before it
    (``times``: the log's :func:`request_times`; H200 2026-12-04, ``bench=serve``: median 2 ms at
    N = 1, 5 ms at 16, 20-28 ms at 64 with a p90 of 135-283 ms: one asyncio process drives all the
    clients, and at 64 it falls behind)."""
    position = {k: i for i, k in enumerate(p.keys)}
    by_key = {r.key: i for i, r in enumerate(run.requests)}
    index = [by_key[k] for k in p.keys if k in by_key]  # arrival order: the periods in order
    ids = {k for i in index for k in (run.requests[i].key, run.requests[i].key.rsplit("#", 1)[0])}
    inside = [s for s in run.steps if p.start <= s.start_time <= p.end]
    steps = [s for s in inside if s.kind == "prefill" or (s.requests and s.requests[0].request_id in ids)]
    settings = dataclasses.replace(run.settings, max_num_seqs=p.concurrency)
    part = dataclasses.replace(run, settings=settings, steps=steps, requests=[run.requests[i] for i in index])
    pick = [bits.bits[i] for i in index], [bits.imputed[i] for i in index]
    num_imputed = sum(sum(m[1 : run.requests[i].output_len - 1]) for i, m in zip(index, pick[1], strict=True))
    draftable = sum(run.requests[i].num_draftable for i in index)
    segments = [p.segments[position[run.requests[i].key]] for i in index]
    think = think_times([t for t in times if t.key in position])
    think_ms = [think.get(run.requests[i].key, 0.0) for i in index]
    pass_bits = MatchBits(pick[0], pick[1], bits.run_mean, draftable, num_imputed, bits.seed)
    return PassPart(p, part, pass_bits, segments, think_ms, window_times(p, times, steps))


def window_times(p: Pass, times: Sequence[RequestTimes], steps) -> list[float]:
    """Per busy period of ``p``: the summed ``total_ms`` of ``steps`` (the pass's) that started between
    its first request's arrival and its last's, plus half the mean gap between its arrivals (the live
    clients stopped sending somewhere before the next would have come; a replay at the live speed
    then sends the last request inside its window, not on its edge) (:class:`PassPart`'s
    ``window_ms``)."""
    position = {k: i for i, k in enumerate(p.keys)}
    arrivals: dict[int, list[float]] = {}
    for t in times:
        if t.key in position:
            arrivals.setdefault(p.segments[position[t.key]], []).append(t.arrival)
    out = []
    for seg in range(max(p.segments, default=-1) + 1):
        got = arrivals.get(seg, [])
        if not got:
            out.append(0.0)
            continue
        lo, hi = min(got), max(got)
        span = sum(s.total_ms for s in steps if lo <= s.start_time <= hi)
        out.append(span + (span / (len(got) - 1) / 2 if len(got) > 1 else 0.0))
    return out


def think_times(times: Sequence[RequestTimes]) -> dict[str, float]:
    """Per request key: ms from its client's previous request's finish to its arrival (0 for a
    client's first request, and for requests without a client)."""
    last: dict[str, float] = {}
    out = {}
    for t in sorted(times, key=lambda t: t.arrival):
        if t.client is not None:
            out[t.key] = max(t.arrival - last[t.client], 0.0) * 1e3 if t.client in last else 0.0
            last[t.client] = t.finish
        else:
            out[t.key] = 0.0
    return out
