"""What a request joining the decode batch costs the step it joins, on the CPU.

A request's first decode step used to pay for its n-gram index: the step's ``view`` (the proposers'
peek) indexed the whole prompt on the critical path. On the H200 on 2026-12-04 (21:20,
``bench=serve_rounds``, n-gram + fixed k = 8 on the MQA graph) the view of a decode step at batch 16
took 0.27 ms with nobody joining and 0.15 ms more per joining request (0.43 / 0.58 / 0.68 ms for 1 /
2 / 3); at batch 64 1.0 ms with nobody joining and 2-3 ms with 8-20. The engine now hands each
prefill's requests to their proposer while the GPU runs the prefill forward (``Proposer.on_prefill``),
so the first peek indexes only the token the prefill emitted.

This runs the real engine (tiny random model, n-gram proposer, fixed k = 8 on eager MQA) under a
closed loop that keeps ``batch`` requests in the engine (a new one joins as soon as one finishes),
prompts of ``--prompt-len`` tokens ending in a repeated motif (n-gram matches), 16-48 output tokens
each, with the start-up heap frozen as the daemon does. For each decode step at the full batch, its
``view`` host ms by the number of requests in their first decode step; and the prefill steps' host
ms (on the CPU the index is built there now; on CUDA it overlaps the prefill forward).

    python -m specsched.bench.join_view [--batch 4 16 64] [--prompt-len 300] [--requests 6]
    python -m specsched.bench.join_view --log run.sqlite [--batch 16 64]

``--log`` reads the same table from a daemon's decision log instead (its decode steps at each batch
size, a request joining at its first ``step_requests`` row): how the H200 numbers above were read.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sqlite3
import statistics
from collections import defaultdict

import torch
from tqdm import tqdm

from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.heap import freeze_heap
from specsched.engine.records import StepRecord
from specsched.engine.request import Request, SamplingParams

MAX_JOINING = 4  # the table's last row pools this many joining requests and more


def build_engine(batch: int) -> Engine:
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32", max_model_len=2048),
        cache=CacheConfig(block_size=16, num_blocks=max(256, batch * 40)),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=4096),
        spec=SpecConfig(proposer="ngram", scorers=["batch_expansion", "mqa"], max_k=8),
        policy={"name": "fixed", "k": 8, "scorer": "mqa"},
    )
    return Engine(cfg)


def run(batch: int, prompt_len: int, num_per_slot: int, seed: int = 0) -> list[StepRecord]:
    """The closed loop's step records (``num_per_slot * batch`` requests in all)."""
    engine = build_engine(batch)
    freeze_heap()  # as the daemon does; thawed at the end (a test process goes on)
    try:
        return _closed_loop(engine, batch, prompt_len, num_per_slot, seed)
    finally:
        gc.unfreeze()


def _closed_loop(
    engine: Engine, batch: int, prompt_len: int, num_per_slot: int, seed: int
) -> list[StepRecord]:
    vocab = engine.model.cfg.vocab_size
    rng = random.Random(seed)
    records: list[StepRecord] = []
    engine.on_step = records.append

    def add(i: int) -> None:
        motif = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 40))]
        head = [rng.randrange(3, vocab) for _ in range(max(0, prompt_len - 3 * len(motif)))]
        sampling = SamplingParams(max_tokens=rng.randint(16, 48), ignore_eos=True)
        engine.add_request(Request(f"j{i}", (head + motif * 3)[:prompt_len], sampling))

    total = num_per_slot * batch
    for i in range(batch):
        add(i)
    num_added = batch
    with tqdm(total=total, desc=f"batch {batch}", unit="req", leave=False) as bar:
        while engine.has_unfinished:
            before = engine.num_running + engine.num_waiting
            engine.step()
            bar.update(before - engine.num_running - engine.num_waiting)
            while num_added < total and engine.num_running + engine.num_waiting < batch:
                add(num_added)
                num_added += 1
    return records


def summarize(records: list[StepRecord], batch: int) -> tuple[dict[int, list[float]], list[float]]:
    """(view ms of the full-batch decode steps by joining requests, prefill steps' host ms)."""
    seen: set[str] = set()
    views: dict[int, list[float]] = defaultdict(list)
    prefill: list[float] = []
    for rec in records:
        if rec.kind == "prefill":
            prefill.append(sum(rec.host_ms.values()))
            continue
        ids = [q.request_id for q in rec.requests]
        joining = sum(1 for i in ids if i not in seen)
        seen.update(ids)
        if rec.batch_size == batch:
            views[min(joining, MAX_JOINING)].append(rec.host_ms.get("view", 0.0))
    return views, prefill


def from_log(path: str, batch: int) -> dict[int, list[float]]:
    """The view ms of a decision log's decode steps of ``batch`` requests, by requests joining."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        joining: dict[tuple[int, int], int] = defaultdict(int)
        seen: set[tuple[int, str]] = set()
        for run_id, step, rid in db.execute(
            "SELECT run_id, step, request_id FROM step_requests ORDER BY run_id, step"
        ):
            if (run_id, rid) not in seen:
                seen.add((run_id, rid))
                joining[(run_id, step)] += 1
        views: dict[int, list[float]] = defaultdict(list)
        rows = db.execute(
            "SELECT run_id, step, host_ms FROM steps WHERE kind = 'decode' AND batch_size = ?", (batch,)
        )
        for run_id, step, host_ms in rows:
            j = min(joining[(run_id, step)], MAX_JOINING)
            views[j].append(json.loads(host_ms or "{}").get("view", 0.0))
        return views
    finally:
        db.close()


def print_views(batch: int, views: dict[int, list[float]]) -> None:
    for j in sorted(views):
        v = views[j]
        label = f"{j}+" if j == MAX_JOINING else str(j)
        print(f"| {batch} | {label} | {len(v)} | {statistics.median(v):.3f} | {statistics.fmean(v):.3f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--requests", type=int, default=6, help="requests per batch slot")
    ap.add_argument("--log", help="read a decision log instead of running the engine")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print("| batch | requests joining | steps | view ms (median) | view ms (mean) |")
    print("|---|---|---|---|---|")
    if args.log:
        for b in args.batch:
            print_views(b, from_log(args.log, b))
        return
    prefills = []
    for b in args.batch:
        views, prefill = summarize(run(b, args.prompt_len, args.requests), b)
        prefills.append((b, prefill))
        print_views(b, views)
    print()
    for b, p in prefills:
        print(f"batch {b}: {len(p)} prefill steps, host ms median {statistics.median(p):.3f}")


if __name__ == "__main__":
    main()
