"""The draft loop graphs (models/draft_loop.py): the loop's tokens and K/V writes against single-token
forwards one at a time, rows that stop in place, the batches that do not fit, and (GPU) real captures
against the eager loop."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specsched.kernels.metadata import build_metadata
from specsched.models.config import get_preset
from specsched.models.draft_loop import DraftLoopGraphs, draft_steps
from specsched.models.llama import LlamaForCausalLM
from specsched.models.random_init import init_random

BLOCK = 4
WIDTH = 8  # blocks per row: positions 0..31


def tiny_model(device: str = "cpu") -> LlamaForCausalLM:
    return init_random(LlamaForCausalLM(get_preset("tiny")).eval(), seed=4, std=0.1).to(device)


def clone_kv(kv):
    return [(k.clone(), v.clone()) for k, v in kv]


def batch(rng: random.Random, rows: int, max_steps: int):
    """Rows each in blocks of their own (block 0 is the pad block), a context already in the cache
    (positions below the first), a first token, and a number of steps (0 included)."""
    blocks = list(range(1, 1 + rows * WIDTH))
    rng.shuffle(blocks)
    tables = np.array([blocks[i * WIDTH : (i + 1) * WIDTH] for i in range(rows)], dtype=np.int32)
    steps = np.array([rng.choice([0, 1, rng.randint(0, max_steps), max_steps]) for _ in range(rows)])
    positions = np.array([rng.randint(1, WIDTH * BLOCK - max_steps - 1) for _ in range(rows)])
    first = torch.tensor([rng.randrange(3, 256) for _ in range(rows)])
    return first, positions, tables, steps


def one_step_at_a_time(model, kv, first, positions, tables, steps) -> list[list[int]]:
    """Each row's tokens from single-token forwards of that row alone, one after another."""
    out, dev = [], model.lm_head.weight.device
    for r in range(len(first)):
        tok, pos, row = int(first[r]), int(positions[r]), []
        for _ in range(int(steps[r])):
            meta = build_metadata([1], [pos + 1], [tables[r].tolist()], BLOCK, dev)
            with torch.inference_mode():
                logits = model(
                    torch.tensor([tok], device=dev), torch.tensor([pos], device=dev), meta, kv, None
                )
            tok, pos = int(logits[0].argmax()), pos + 1
            row.append(tok)
        out.append(row)
    return out


def filled_cache(model: LlamaForCausalLM, seed: int):
    kv = model.allocate_kv_cache(1 + 8 * WIDTH, BLOCK)
    gen = torch.Generator().manual_seed(seed)
    for k, v in kv:  # a context in every slot: the loop's rows attend to it
        k.copy_(torch.randn(k.shape, generator=gen) * 0.5)
        v.copy_(torch.randn(v.shape, generator=gen) * 0.5)
    return kv


@pytest.mark.parametrize("seed", range(3))
def test_the_loop_equals_single_steps_and_writes_only_its_rows_positions(seed):
    rng = random.Random(seed)
    model = tiny_model()
    kv = filled_cache(model, seed)
    first, positions, tables, steps = batch(rng, rng.randint(1, 6), 5)
    ref_kv = clone_kv(kv)
    want = one_step_at_a_time(model, ref_kv, first, positions, tables, steps)
    out = torch.full((5, len(first)), -1, dtype=torch.int64)
    with torch.inference_mode():
        draft_steps(model, kv, first, torch.from_numpy(positions), torch.from_numpy(tables),
                    torch.from_numpy(steps), out, BLOCK, WIDTH * BLOCK)  # fmt: skip
    got = [out[: int(n), r].tolist() for r, n in enumerate(steps)]
    assert got == want
    # the K/V: the same slots written as one step at a time (the pad block 0 aside), the rest untouched
    # (a batched GEMM rounds a row unlike a one-row one: ~1e-6 apart; a wrong slot is ~0.5 off)
    for (k, v), (rk, rv) in zip(kv, ref_kv):
        torch.testing.assert_close(k[1:], rk[1:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v[1:], rv[1:], rtol=1e-4, atol=1e-4)


def test_a_row_without_steps_writes_nothing_and_pad_rows_stay_in_the_pad_block():
    model = tiny_model()
    kv = filled_cache(model, 7)
    before = clone_kv(kv)
    tables = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [0] * WIDTH], dtype=torch.int32)
    out = torch.zeros(3, 2, dtype=torch.int64)
    with torch.inference_mode():
        draft_steps(model, kv, torch.tensor([5, 0]), torch.tensor([9, 0]), tables, torch.tensor([0, 0]), out,
                    BLOCK, WIDTH * BLOCK)  # fmt: skip
    for (k, v), (bk, bv) in zip(kv, before):
        assert torch.equal(k[1:], bk[1:]) and torch.equal(v[1:], bv[1:])


def runner(model, **kw) -> DraftLoopGraphs:
    return DraftLoopGraphs(
        model, filled_cache(model, 1), [1, 2, 4], 4, WIDTH, emulate=True, progress=False, **kw
    )


def test_runs_that_do_not_fit_fall_back_and_are_counted():
    model = tiny_model()
    loop = runner(model)
    assert loop.num_graphs == 3 * 4
    first = torch.tensor([5, 6])
    tables = np.arange(1, 1 + 2 * WIDTH, dtype=np.int32).reshape(2, WIDTH)
    full = np.full(2, WIDTH)
    assert loop.run(first, np.array([3, 9]), tables, full, np.array([2, 4])).shape == (4, 2)
    assert loop.run(first, np.array([3, 9]), tables, full, np.array([0, 0])) is None  # no steps
    assert loop.run(first, np.array([3, 9]), tables, full, np.array([2, 5])) is None  # steps > captured
    five = torch.arange(5)
    t5 = np.arange(1, 1 + 5 * WIDTH, dtype=np.int32).reshape(5, WIDTH) % (1 + 8 * WIDTH)
    assert loop.run(five, np.full(5, 3), t5, np.full(5, WIDTH), np.full(5, 2)) is None  # rows > captured
    # the second row's steps would leave its 3 blocks (positions 10, 11, 12: block 3)
    assert loop.run(first, np.array([3, 10]), tables, np.array([WIDTH, 3]), np.array([2, 3])) is None
    wide = np.zeros((2, WIDTH + 1), dtype=np.int32)
    assert loop.run(first, np.array([3, 9]), wide, full, np.array([1, 1])) is None  # wider than captured
    assert loop.num_replays == 1 and loop.num_misses == 5
    assert loop.stats()["num_misses"] == 5


def test_the_runner_pads_a_batch_into_its_bucket_and_equals_the_eager_loop():
    """3 rows run in the 4-row graph (a pad row beside them); the tokens equal the eager loop's."""
    rng = random.Random(11)
    model = tiny_model()
    loop = runner(model)
    first, positions, tables, steps = batch(rng, 3, 4)
    steps[0] = 4
    kv = clone_kv(loop.kv_cache)
    got = loop.run(first, positions, tables, np.full(3, WIDTH), steps)
    want = torch.zeros(4, 3, dtype=torch.int64)
    with torch.inference_mode():
        draft_steps(model, kv, first, torch.from_numpy(positions), torch.from_numpy(tables),
                    torch.from_numpy(steps), want, BLOCK, WIDTH * BLOCK)  # fmt: skip
    for r, n in enumerate(steps):
        assert got[: int(n), r].tolist() == want[: int(n), r].tolist()
    # the first tokens from the host (a shared-cache self-draft's last committed tokens), uploaded
    # with the rest: the same tokens as from the device (each run writes a position before reading it)
    from_host = loop.run(first.numpy(), positions, tables, np.full(3, WIDTH), steps).clone()
    from_dev = loop.run(first, positions, tables, np.full(3, WIDTH), steps)
    assert torch.equal(from_host, from_dev)
    model = tiny_model()
    kv = model.allocate_kv_cache(4, BLOCK)
    with pytest.raises(ValueError, match="need the model on CUDA"):
        DraftLoopGraphs(model, kv, [1], 2, WIDTH, progress=False)
    with pytest.raises(ValueError, match="max_steps >= 1"):
        DraftLoopGraphs(model, kv, [1], 0, WIDTH, emulate=True, progress=False)


# ---- GPU -----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(2))
def test_cuda_captured_loop_equals_single_steps(seed):
    """Real CUDA graphs (the Triton attention captured) against single-token forwards one at a time
    (fp32, the tiny preset): the same tokens."""
    rng = random.Random(100 + seed)
    model = tiny_model("cuda")
    kv = [(k.cuda(), v.cuda()) for k, v in filled_cache(tiny_model(), seed)]
    loop = DraftLoopGraphs(model, kv, [1, 2, 4, 8], 5, WIDTH, progress=False)
    first, positions, tables, steps = batch(rng, 7, 5)
    steps[0] = 5
    want = one_step_at_a_time(model, clone_kv(kv), first.cuda(), positions, tables, steps)
    got = loop.run(first.cuda(), positions, tables, np.full(7, WIDTH), steps)
    print("GPU draft loop:", loop.stats())
    assert [got[: int(n), r].tolist() for r, n in enumerate(steps)] == want


def test_the_option_is_validated_and_reaches_the_graph_config():
    from specsched.engine.config import DraftConfig, EngineConfig, SpecConfig
    from specsched.scorers.graph import GraphConfig

    assert DraftConfig().loop_graphs is False  # off until measured
    with pytest.raises(ValueError, match="draft.loop_graphs must be true or false, got 'yes'"):
        DraftConfig(loop_graphs="yes")
    cfg = EngineConfig(spec=SpecConfig(proposer="draft", draft=DraftConfig(loop_graphs=True)))
    assert GraphConfig.for_engine(cfg, 256).draft_loop is True
    assert GraphConfig.for_engine(EngineConfig(), 256).draft_loop is False
