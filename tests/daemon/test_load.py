"""Load: 1,000 requests from 50 concurrent clients against one daemon, counted message by message.

Each client is a raw asyncio DEALER socket (so every message the daemon sends is seen, not just what a
client library chooses to surface). All clients use the same request ids, with different prompts per
client for the same id, so a reply routed to the wrong client would carry the wrong tokens: every
output is compared with the in-process greedy reference for its prompt. The daemon's RSS is sampled
from /proc while it runs, and every request must be in the SQLite log. A second daemon with a tiny KV
cache makes requests wait and be preempted: all still finish, losslessly, and ``stats`` shows it.
``pytest -m soak`` runs the long variant (20,000 requests).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import msgpack
import pytest
import zmq
import zmq.asyncio

from specsched.client.sync_client import Client

NUM_PROMPTS = 16
MB = 1 << 20


def prompt(i: int) -> list[int]:
    base = [3 + (i * 7) % 200, 4 + (i * 11) % 200, 5 + (i * 13) % 200]
    return base * 3 + [9 + i]


def max_tokens(i: int) -> int:
    return 4 + i % 5  # 4..8


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of the NUM_PROMPTS prompts, from an in-process engine with the daemons' config."""
    import torch

    from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
    from specsched.engine.engine import Engine
    from specsched.engine.request import SamplingParams

    engine = Engine.from_config(
        EngineConfig(
            model=ModelConfig(source="tiny", dtype="float32", device="cpu", attn_backend="torch"),
            cache=CacheConfig(block_size=16, num_blocks=256),
            spec=SpecConfig(proposer="ngram", max_k=4),
        )
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompts = [prompt(i) for i in range(NUM_PROMPTS)]
        return engine.generate(prompts, [SamplingParams(max_tokens=64) for _ in prompts])
    finally:
        torch.set_num_threads(threads)


@dataclass
class ClientLog:
    """Everything one client received, per request id."""

    sent: dict[str, int] = field(default_factory=dict)  # id -> prompt index
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finals: dict[str, list[dict]] = field(default_factory=dict)  # id -> its done / error messages
    after_final: int = 0  # messages for an id after its done / error
    unknown: int = 0  # messages for ids this client never sent


async def run_client(ctx, endpoint: str, k: int, num_requests: int, window: int, log: ClientLog) -> None:
    """Send ``num_requests`` generates (ids r0.., at most ``window`` in flight), half streamed; record
    every reply. Request j of client k uses prompt (7k + j) mod NUM_PROMPTS."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    slots = asyncio.Semaphore(window)
    done = asyncio.Event()
    open_ids: set[str] = set()

    async def receive() -> None:
        while len(log.finals) < num_requests:
            msg = msgpack.unpackb(await sock.recv())
            rid = msg.get("id")
            if rid not in log.sent:
                log.unknown += 1
            elif rid not in open_ids:
                log.after_final += 1
            elif msg["type"] == "chunk":
                log.tokens[rid].extend(msg["token_ids"])
            else:
                if msg["type"] == "done" and msg["token_ids"] is not None:
                    log.tokens[rid].extend(msg["token_ids"])
                log.finals.setdefault(rid, []).append(msg)
                open_ids.discard(rid)
                slots.release()
        done.set()

    reader = asyncio.create_task(receive())
    try:
        for j in range(num_requests):
            await slots.acquire()
            rid, p = f"r{j}", (7 * k + j) % NUM_PROMPTS
            log.sent[rid], log.tokens[rid] = p, []
            open_ids.add(rid)
            await sock.send(
                msgpack.packb(
                    {
                        "v": 1,
                        "type": "generate",
                        "id": rid,
                        "prompt_ids": prompt(p),
                        "max_tokens": max_tokens(p),
                        "stream": j % 2 == 0,
                    }  # fmt: skip
                )
            )
        await asyncio.wait_for(done.wait(), 300)
        await asyncio.sleep(0.2)  # anything stray (a second done) would arrive now
        while await sock.poll(0):
            msg = msgpack.unpackb(await sock.recv())
            log.after_final += 1 if msg.get("id") in log.sent else 0
            log.unknown += 0 if msg.get("id") in log.sent else 1
    finally:
        reader.cancel()
        sock.close()


class RssSampler:
    """Samples a daemon's VmRSS every ``interval_s`` in a thread."""

    def __init__(self, daemon, interval_s: float = 0.05) -> None:
        self.daemon, self.interval_s = daemon, interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.daemon.rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_load(endpoint: str, num_clients: int, per_client: int, window: int) -> list[ClientLog]:
    async def main():
        ctx = zmq.asyncio.Context()
        logs = [ClientLog() for _ in range(num_clients)]
        try:
            await asyncio.gather(
                *(run_client(ctx, endpoint, k, per_client, window, logs[k]) for k in range(num_clients))
            )
        finally:
            ctx.term()
        return logs

    return asyncio.run(main())


def check_replies(logs: list[ClientLog], reference: list[list[int]]) -> Counter:
    """Every request: exactly one final message, nothing after it, no foreign ids, and the greedy
    reference's tokens for its prompt. Returns the finish reasons."""
    reasons: Counter = Counter()
    for k, log in enumerate(logs):
        assert log.unknown == 0 and log.after_final == 0, (k, log.unknown, log.after_final)
        assert set(log.finals) == set(log.sent), f"client {k}: lost {set(log.sent) - set(log.finals)}"
        for rid, finals in log.finals.items():
            assert len(finals) == 1, (k, rid, finals)
            final = finals[0]
            assert final["type"] == "done", (k, rid, final)
            p = log.sent[rid]
            want = reference[p][: max_tokens(p)]
            assert log.tokens[rid] == want, f"client {k} {rid} (prompt {p}): wrong tokens"
            assert final["usage"]["completion_tokens"] == len(want)
            reasons[final["finish_reason"]] += 1
    return reasons


def wait_for_log_rows(path, expected: int, timeout_s: float = 30.0) -> list[tuple]:
    deadline = time.monotonic() + timeout_s
    while True:
        db = sqlite3.connect(path)
        try:
            rows = db.execute(
                "SELECT request_id, output_tokens, finish_reason FROM requests "
                "WHERE run_id = (SELECT max(id) FROM runs)"
            ).fetchall()
        finally:
            db.close()
        if len(rows) >= expected or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def load_test(start_daemon, reference, num_clients: int, per_client: int) -> dict:
    assert len({tuple(r[: max_tokens(i)]) for i, r in enumerate(reference)}) == NUM_PROMPTS, (
        "the reference outputs must differ per prompt, or misrouting could go unseen"
    )
    d = start_daemon(daemon={"max_inflight_per_client": 64}, log_db=True)
    with Client(d.endpoint, timeout_s=60) as c:  # warm up (first steps allocate)
        warm = c.generate(prompt_ids=prompt(0), max_tokens=4)
    baseline = d.rss_bytes()
    t0 = time.perf_counter()
    with RssSampler(d) as rss:
        logs = run_load(d.endpoint, num_clients, per_client, window=4)
    wall_s = time.perf_counter() - t0
    reasons = check_replies(logs, reference)
    total = num_clients * per_client
    assert sum(reasons.values()) == total

    rows = wait_for_log_rows(d.log_path, total + 1)
    got = Counter((rid.split(":", 1)[1], n, reason) for rid, n, reason in rows)
    want = Counter(
        (rid, len(log.tokens[rid]), log.finals[rid][0]["finish_reason"]) for log in logs for rid in log.sent
    )
    want[(warm.id, len(warm.token_ids), warm.finish_reason)] += 1
    assert got == want, "the log's requests table differs from what the clients received"

    with Client(d.endpoint, timeout_s=60) as c:
        stats = c.stats()
    assert stats.num_requests_done == total + 1 and stats.num_inflight == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert 0 < stats.rss_bytes < 2 * d.rss_bytes()
    peak = max(rss.samples)
    figures = dict(
        requests=total,
        wall_s=round(wall_s, 2),
        baseline_mb=round(baseline / MB, 1),
        peak_mb=round(peak / MB, 1),
        end_mb=round(rss.samples[-1] / MB, 1),
        lost=0,
    )
    print(f"\nload figures: {figures}")
    assert peak - baseline < 64 * MB, figures
    d.stop()
    return figures


def test_1000_requests_from_50_concurrent_clients(start_daemon, reference):
    load_test(start_daemon, reference, num_clients=50, per_client=20)


@pytest.mark.soak
def test_soak_20000_requests_from_50_clients(start_daemon, reference):
    load_test(start_daemon, reference, num_clients=50, per_client=400)


def test_small_kv_cache_queues_and_preempts_but_never_fails(start_daemon, reference):
    """9 usable blocks of 16 slots: 30 requests of 10 + 30 tokens cannot run together. They wait in
    the queue or are preempted and recomputed; all finish with the reference's tokens."""
    d = start_daemon(num_blocks=10, daemon={"max_inflight_per_client": 64})
    n, want_tokens = 30, 30
    peaks = {"waiting": 0, "running": 0}

    async def main():
        from specsched.client.sync_client import AsyncClient

        async with AsyncClient(d.endpoint, timeout_s=120) as watcher:
            clients = [AsyncClient(d.endpoint, timeout_s=120) for _ in range(6)]
            tasks = [
                clients[i % 6].generate(
                    prompt_ids=prompt(i % NUM_PROMPTS), max_tokens=want_tokens, id=f"q{i}"
                )
                for i in range(n)
            ]
            pending = asyncio.gather(*tasks)
            while not pending.done():
                s = await watcher.stats()
                peaks["waiting"] = max(peaks["waiting"], s.num_waiting)
                peaks["running"] = max(peaks["running"], s.num_running)
                await asyncio.sleep(0.01)
            results = await pending
            for c in clients:
                await c.close()
            # alone, a request longer than the whole cache is capped to it rather than never finishing
            big = await watcher.generate(prompt_ids=prompt(1), max_tokens=1000)
            return results, big, await watcher.stats()

    results, big, stats = asyncio.run(main())
    for i, r in enumerate(results):
        assert r.finish_reason in ("length", "stop")
        assert r.token_ids == reference[i % NUM_PROMPTS][:want_tokens], i
    assert peaks["waiting"] > 0, peaks
    assert stats.num_preemptions > 0, stats
    assert stats.num_free_blocks == stats.num_total_blocks == 9
    kv_slots = 9 * 16
    assert big.finish_reason == "length" and big.usage.completion_tokens == kv_slots - len(prompt(1))
    print(f"\nsmall KV: peak waiting {peaks['waiting']}, running {peaks['running']}, "
          f"preemptions {stats.num_preemptions}")  # fmt: skip
