"""Prefill chunks on graphs: a runner in last-token mode gives each row's last-token logits of the
eager forward and writes the same KV (CPU: the runner's ``emulate`` mode; GPU: captured, bf16)."""

from __future__ import annotations

import random

import pytest
import torch

from specsched.models.config import get_preset
from specsched.models.cuda_graphs import GraphRunner
from specsched.models.graph_buckets import GraphBucket, prefill_buckets
from specsched.models.llama import LlamaForCausalLM
from specsched.models.random_init import init_random
from specsched.scorers.inputs import chunk_host_inputs

BLOCK = 4
WIDTH = 32  # captured block-table width: 128 keys


def tiny_model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    model = init_random(LlamaForCausalLM(get_preset("tiny")).eval(), seed=0, std=0.1)
    return model.to(device=device, dtype=dtype)


def test_prefill_buckets_are_powers_of_two_up_to_the_limits():
    got = prefill_buckets(8, 512)
    assert len(got) == 20
    assert {b.rows for b in got} == {1, 2, 4, 8} and {b.tokens for b in got} == {32, 64, 128, 256, 512}
    assert all(b.max_q == b.tokens for b in got)
    assert prefill_buckets(3, 100) == [GraphBucket(r, t, t) for r in (1, 2, 3) for t in (32, 64, 100)]
    assert prefill_buckets(1, 16) == [GraphBucket(1, 16, 16)]
    with pytest.raises(ValueError, match="max_rows, max_tokens >= 1"):
        prefill_buckets(0, 512)


def random_chunks(rng: random.Random, num_blocks: int) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """1-3 rows: each a prompt chunk of 1..40 tokens after a cached prefix of 0..30 (prefix KV random)."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tokens, starts, tables = [], [], []
    for _ in range(rng.randint(1, 3)):
        start, n = rng.randint(0, 30), rng.randint(1, 40)
        blocks = -(-(start + n) // BLOCK)
        tables.append([free.pop() for _ in range(blocks)])
        tokens.append([rng.randrange(3, 256) for _ in range(n)])
        starts.append(start)
    return tokens, starts, tables


def run_both(device: str, dtype: torch.dtype, seed: int, emulate: bool):
    rng = random.Random(seed)
    model = tiny_model(device, dtype)
    kv = model.allocate_kv_cache(200, BLOCK)
    for k, v in kv:  # the cached prefixes' keys and values
        k.normal_()
        v.normal_()
    runner = GraphRunner(model, [(k.clone(), v.clone()) for k, v in kv], prefill_buckets(4, 64), WIDTH,
                         emulate=emulate, progress=False, last_token_logits=True)  # fmt: skip
    tokens, starts, tables = random_chunks(rng, 200)
    x = chunk_host_inputs(tokens, starts, tables, BLOCK)
    got = runner.run_host(x).clone()
    ids, pos, meta, last = x.to_device(device)
    want = model(ids, pos, meta, kv, last)
    return got, want, runner, kv, tables


@pytest.mark.parametrize("seed", range(4))
def test_emulated_last_token_graphs_equal_the_eager_forward(seed):
    got, want, runner, kv, tables = run_both("cpu", torch.float32, seed, emulate=True)
    assert got.shape == want.shape == (len(tables), runner.model.cfg.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    used = sorted({b for t in tables for b in t})
    for (k, v), (k2, v2) in zip(kv, runner.kv_cache):  # the chunk's KV written alike (block 0: pads)
        torch.testing.assert_close(k[used], k2[used])
        torch.testing.assert_close(v[used], v2[used])
    assert runner.num_replays == 1 and runner.num_eager_fallbacks == 0


def test_last_token_runner_checks_its_inputs():
    model = tiny_model()
    kv = model.allocate_kv_cache(50, BLOCK)
    runner = GraphRunner(model, kv, prefill_buckets(2, 32), WIDTH, emulate=True, progress=False,
                         last_token_logits=True)  # fmt: skip
    x = chunk_host_inputs([[5, 6, 7], [8, 9]], [0, 0], [[1], [2]], BLOCK, logits_rows=[1])
    with pytest.raises(ValueError, match="last tokens: pass those as logits_indices"):
        runner.run_host(x)
    ids, pos, meta, _ = x.to_device("cpu")
    with pytest.raises(ValueError, match="use run_host"):
        runner.run(ids, pos, meta)
    assert runner.logits.shape[0] == 2  # one row of logits per row, not per token


def test_a_chunk_outside_the_buckets_is_no_bucket():
    model = tiny_model()
    runner = GraphRunner(model, model.allocate_kv_cache(50, BLOCK), prefill_buckets(2, 32), WIDTH,
                         emulate=True, progress=False, last_token_logits=True)  # fmt: skip
    x = chunk_host_inputs([list(range(3, 43))], [0], [list(range(1, 11))], BLOCK)
    bucket, reason, _ = runner.bucket_for(x)
    assert bucket is None and reason == "tokens above largest bucket"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(3))
def test_gpu_captured_prefill_graphs_equal_the_eager_forward_bf16(seed):
    got, want, runner, kv, tables = run_both("cuda", torch.bfloat16, seed, emulate=False)
    err = ((got - want).norm() / want.norm()).item()
    print(f"GPU bf16 prefill graph vs eager: rel. error {err:.2e}")
    assert err < 1e-2 and runner.num_replays == 1 and runner.num_eager_fallbacks == 0
