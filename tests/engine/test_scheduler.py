"""Block allocator and scheduler bookkeeping."""

from __future__ import annotations

import random

import pytest

from specsched.engine.config import CacheConfig, SchedulerConfig
from specsched.engine.request import FinishReason, Request, SamplingParams
from specsched.engine.scheduler import BlockAllocator, NoFreeBlocks, Scheduler


def test_allocator_reserves_block_zero_and_never_double_allocates():
    a = BlockAllocator(10)
    got = a.allocate(9)
    assert sorted(got) == list(range(1, 10))
    with pytest.raises(NoFreeBlocks, match="asked for 1 KV blocks, 0 free"):
        a.allocate(1)
    a.free(got[:4])
    assert a.num_free == 4
    with pytest.raises(ValueError, match="at least 2"):
        BlockAllocator(1)


def test_random_reserve_trim_release_never_leaks():
    rng = random.Random(0)
    s = Scheduler(SchedulerConfig(), CacheConfig(block_size=4), 64)
    reqs = [Request(str(i), [1] * rng.randint(1, 20), SamplingParams()) for i in range(6)]
    for _ in range(500):
        r = rng.choice(reqs)
        op = rng.random()
        if op < 0.5:
            s.reserve(r, r.num_tokens + rng.randint(0, 9))
        elif op < 0.8:
            r.output_ids.extend([2] * rng.randint(0, 3))
            s.trim(r)
            assert len(r.block_table) <= s.blocks_for(r.num_tokens)
        else:
            s.release(r)
        owned = [b for q in reqs for b in q.block_table]
        assert len(owned) == len(set(owned)) and 0 not in owned
        assert len(owned) + s.num_free_blocks == 63
    for r in reqs:
        s.release(r)
    assert s.num_free_blocks == 63


def test_schedule_prefills_in_chunks_then_decodes():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8), CacheConfig(block_size=4), 64)
    r = Request("a", list(range(20)), SamplingParams())
    s.add(r)
    chunks = []
    while (b := s.schedule()) is not None and b.is_prefill:
        chunks.append(b.chunk_lens[0])
        r.num_computed += b.chunk_lens[0]
    assert chunks == [8, 8, 4]
    r.output_ids.append(5)
    r.num_computed = r.num_tokens - 1
    b = s.schedule()
    assert b is not None and not b.is_prefill and b.requests == [r]
    s.finish(r, FinishReason.STOP)
    assert s.num_free_blocks == 63 and not s.running


def test_prefill_limits_cap_prompts_and_tokens_per_step():
    # graphs of <= 2 prompts x 10 tokens: three 8-token prompts go 8+2, then 6+4 (two prompts), then 4
    cfg = SchedulerConfig(max_num_batched_tokens=16)
    s = Scheduler(cfg, CacheConfig(block_size=4), 64, prefill_limits=(2, 10))
    reqs = [Request(c, list(range(8)), SamplingParams()) for c in "abc"]
    for r in reqs:
        s.add(r)
    steps = []
    while (b := s.schedule()) is not None and b.is_prefill:
        steps.append([(r.request_id, n) for r, n in zip(b.requests, b.chunk_lens)])
        for r, n in zip(b.requests, b.chunk_lens):
            r.num_computed += n
    assert steps == [[("a", 8), ("b", 2)], [("b", 6), ("c", 4)], [("c", 4)]]
    with pytest.raises(ValueError, match="prefill_limits"):
        Scheduler(SchedulerConfig(), CacheConfig(), 64, prefill_limits=(0, 10))


def test_lookahead_lowers_k_then_preempts_newest():
    s = Scheduler(SchedulerConfig(), CacheConfig(block_size=4), 6)  # 5 usable blocks
    a, b = Request("a", [1] * 7, SamplingParams()), Request("b", [1] * 7, SamplingParams())
    for r in (a, b):
        s.add(r)
        s.running.append(s.waiting.popleft())
        assert s.reserve(r, 8)
        r.output_ids.append(3)
        r.num_computed = 7
    kept, ks = s.reserve_lookahead([a, b], [8, 8])
    assert kept == [a, b] and ks == [0, 0]  # k dropped to fit: 3 + 2 + ... blocks
    a.output_ids.extend([3] * 4)
    b.output_ids.extend([3] * 4)
    kept, ks = s.reserve_lookahead([a, b], [2, 2])
    assert kept == [a] and s.num_preemptions == 1 and s.waiting[0] is b and b.num_computed == 0
