"""The graph runner's host path: one byte buffer per step, padded on the host, uploaded in one copy.

- :meth:`HostInputs.write` pads exactly like the device reference :func:`pad_inputs` (pad tokens and
  pad rows point at block 0, block-table columns beyond the real width are 0);
- ``run_host`` gives the eager forward's logits for mixed batches (ragged k, pad rows and pad
  tokens), with drafts gathered on the host or scattered on the device, and leaves every KV block
  but the pad block as the eager forward leaves it;
- a replay costs one device op outside the forward (the upload), plus one per scatter / index select;
- misses fall back to the eager forward (counted); ``GraphForward.run_host`` serves draft steps.
CPU runs use the runner's ``emulate`` mode (replay re-runs the forward on the static buffer's views).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specsched.models.config import get_preset
from specsched.models.cuda_graphs import GraphRunner
from specsched.models.graph_buckets import (
    PAD_SLOT,
    GraphBucket,
    InputLayout,
    decode_buckets,
    mqa_buckets,
    pad_inputs,
)
from specsched.models.llama import LlamaForCausalLM
from specsched.models.random_init import init_random
from specsched.scorers.graph import GraphForward
from specsched.scorers.inputs import chunk_host_inputs
from specsched.scorers.metadata_gpu import pack_scoring_batch, scoring_host_inputs

BLOCK = 4
WIDTH = 16  # captured block-table width


def tiny_model(device: str = "cpu") -> LlamaForCausalLM:
    return init_random(LlamaForCausalLM(get_preset("tiny")).eval(), seed=0, std=0.1).to(device)


def clone_kv(kv):
    return [(k.clone(), v.clone()) for k, v in kv]


class CountOps(TorchDispatchMode):
    """Non-view aten ops (each a kernel launch on a GPU) while not inside a replay."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.is_paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.is_paused and not func.is_view and str(func) != "aten.lift_fresh.default":
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def pause_in_replays(runner: GraphRunner, counter: CountOps) -> None:
    for g in runner._graphs.values():
        inner = g.fn

        def fn(inner=inner):
            counter.is_paused = True
            try:
                inner()
            finally:
                counter.is_paused = False

        g.fn = fn


# ---- layout and padding ---------------------------------------------------------------------------
def test_layout_views_are_disjoint_aligned_and_cover_the_buffer():
    lay = InputLayout(tokens=5, rows=3, width=7).with_tails(2, 4, 3)
    buf = np.zeros(lay.nbytes, dtype=np.uint8)
    views = lay.split(buf)
    assert [v.shape for v in views] == [(5,), (5,), (5,), (4,), (3,), (3, 7), (2,), (4,), (3,)]
    spans = sorted((v.ctypes.data - buf.ctypes.data, v.nbytes) for v in views)
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert a + n <= b  # disjoint
    assert all(
        off % v.itemsize == 0 for (off, _), v in zip(spans, sorted(views, key=lambda v: v.ctypes.data))
    )
    assert spans[-1][0] + spans[-1][1] == lay.nbytes and lay.base_nbytes % 8 == 0
    tv = lay.split(torch.zeros(lay.nbytes, dtype=torch.uint8))
    assert [tuple(v.shape) for v in tv] == [v.shape for v in views]
    assert [v.dtype for v in tv] == [torch.int64] * 3 + [torch.int32] * 3 + [torch.int64] * 3


@pytest.mark.parametrize("seed", range(8))
def test_host_padding_equals_device_reference(seed):
    rng = random.Random(seed)
    r = rng.randint(0, 5)
    q = [rng.randint(1, 4) for _ in range(r)]
    tables = [[rng.randrange(1, 99) for _ in range(rng.randint(1, 5))] for _ in range(r)]
    k = [min(len(tb) * BLOCK, qi + rng.randint(0, 8)) for qi, tb in zip(q, tables)]
    starts = [ki - qi for ki, qi in zip(k, q)]
    x = chunk_host_inputs([[rng.randrange(256) for _ in range(qi)] for qi in q], starts, tables, BLOCK)
    rows, tokens, width = (
        x.num_rows + rng.randint(0, 4),
        x.num_tokens + rng.randint(0, 6),
        x.width + rng.randint(0, 3),
    )
    lay = InputLayout(tokens, rows, width, *x.num_tails)
    buf = np.full(lay.nbytes + 16, 0xAB, dtype=np.uint8)  # garbage: every byte of the layout must be written
    x.write(lay, buf)
    ids, pos, slots, cu, seq, tb, *_ = lay.split(buf[: lay.nbytes])
    dids, dpos, dmeta, _ = x.to_device("cpu")
    want_ids, want_pos, want = pad_inputs(dids, dpos, dmeta, rows, tokens, width, 9, 99)
    np.testing.assert_array_equal(ids, want_ids.numpy())
    np.testing.assert_array_equal(pos, want_pos.numpy())
    np.testing.assert_array_equal(slots, want.slot_mapping.numpy())
    np.testing.assert_array_equal(cu, want.cu_seqlens_q.numpy())
    np.testing.assert_array_equal(seq, want.seq_lens_k.numpy())
    np.testing.assert_array_equal(tb, want.block_tables.numpy())
    assert (slots[x.num_tokens :] == PAD_SLOT).all() and (tb[x.num_rows :] == 0).all()
    assert (buf[lay.nbytes :] == 0xAB).all()  # nothing written past the layout
    if x.num_tokens:
        with pytest.raises(ValueError, match="cannot pad"):
            x.write(InputLayout(x.num_tokens - 1, rows, width, *x.num_tails), buf)
        with pytest.raises(ValueError, match="layout tails"):
            x.write(InputLayout(tokens, rows, width), buf)


# ---- run_host == eager -----------------------------------------------------------------------------
@pytest.mark.parametrize("is_expanded", [False, True], ids=["mqa", "expanded"])
@pytest.mark.parametrize("scatter", [False, True], ids=["host-drafts", "device-drafts"])
@pytest.mark.parametrize("seed", range(3))
def test_run_host_equals_eager_forward_with_padding(seed, scatter, is_expanded, decoding_batch):
    rng = random.Random(seed * 10 + scatter)
    model = tiny_model()
    kv = model.allocate_kv_cache(200, BLOCK)
    reqs, props = decoding_batch(model, kv, rng, rng.randint(1, 5))
    runner = GraphRunner(
        model, kv, decode_buckets(24) + mqa_buckets(8, 6), WIDTH, emulate=True, progress=False
    )
    sb = pack_scoring_batch(reqs, props, BLOCK)
    x = scoring_host_inputs(sb, props.draft_tokens, is_expanded=is_expanded, scatter_drafts=scatter)
    b, _, _ = runner.find_bucket(x.num_rows, x.num_tokens, x.max_q, x.width, x.max_k)
    assert b is not None and x.width < WIDTH  # padded (block-table width at least; rows/tokens mostly)
    ref_kv = clone_kv(kv)
    ids, pos, meta, _ = scoring_host_inputs(sb, props.draft_tokens, is_expanded=is_expanded).to_device("cpu")
    with torch.inference_mode():
        want = model(ids, pos, meta, ref_kv)
    counter = CountOps()
    pause_in_replays(runner, counter)
    with counter:
        got = runner.run_host(x, props.draft_tokens if scatter else None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # outside the replay: the one upload (+ the draft scatter); on a GPU that is all the step's input work
    assert counter.ops == ["aten.copy_.default"] + (["aten.index_copy_.default"] if scatter else [])
    assert runner.num_replays == 1 and runner.num_eager_fallbacks == 0
    for (k, v), (rk, rv) in zip(kv, ref_kv, strict=True):  # only the pad block differs
        torch.testing.assert_close(k[1:], rk[1:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[1:], rv[1:], atol=1e-5, rtol=1e-5)


def test_replays_of_different_buckets_reuse_the_buffer_correctly(decoding_batch):
    """Buckets' layouts overlap in the one static buffer: a small batch after a large one must not
    read the large one's leftovers."""
    rng = random.Random(11)
    model = tiny_model()
    kv = model.allocate_kv_cache(300, BLOCK)
    runner = GraphRunner(
        model, kv, decode_buckets(16) + mqa_buckets(8, 6), WIDTH, emulate=True, progress=False
    )
    for num in (7, 1, 5, 2):
        reqs, props = decoding_batch(model, kv, rng, num)
        sb = pack_scoring_batch(reqs, props, BLOCK)
        ref_kv = clone_kv(kv)
        ids, pos, meta, _ = scoring_host_inputs(sb, props.draft_tokens, is_expanded=False).to_device("cpu")
        with torch.inference_mode():
            want = model(ids, pos, meta, ref_kv)
        got = runner.run_host(scoring_host_inputs(sb, props.draft_tokens, is_expanded=False))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert runner.num_replays == 4 and runner.stats()["num_staging_waits"] == 0


def test_run_host_outside_buckets_runs_eagerly_and_counts(decoding_batch):
    rng = random.Random(4)
    model = tiny_model()
    kv = model.allocate_kv_cache(300, BLOCK)
    runner = GraphRunner(
        model, kv, decode_buckets(2) + mqa_buckets(2, 3), WIDTH, emulate=True, progress=False
    )
    reqs, props = decoding_batch(model, kv, rng, 4, max_k=5)
    x = scoring_host_inputs(pack_scoring_batch(reqs, props, BLOCK), props.draft_tokens, is_expanded=False)
    ids, pos, meta, _ = x.to_device("cpu")
    with torch.inference_mode():
        want = model(ids, pos, meta, clone_kv(kv))
    torch.testing.assert_close(runner.run_host(x), want, atol=1e-5, rtol=1e-5)
    assert runner.num_eager_fallbacks == 1 and runner.num_replays == 0
    with pytest.raises(ValueError, match="device ids and HostInputs.scatter_index"):
        runner.run_host(x, props.draft_tokens)


def test_graph_forward_run_host_serves_draft_steps():
    rng = random.Random(5)
    model = tiny_model()
    kv = model.allocate_kv_cache(100, BLOCK, num_layers=2)
    runner = GraphRunner(
        model, kv, decode_buckets(8) + mqa_buckets(8, 2), WIDTH, 2, emulate=True, progress=False
    )
    fwd = GraphForward(runner)
    tables = [[rng.randrange(1, 100) for _ in range(4)] for _ in range(3)]
    for q_lens, num_ops in (([1, 1, 1], 1), ([2, 1, 2], 2), ([3, 1, 2], None)):  # decode, q <= 2, eager
        tokens = [[rng.randrange(256) for _ in range(q)] for q in q_lens]
        x = chunk_host_inputs(tokens, [5, 6, 7], tables, BLOCK)
        ids, pos, meta, last = x.to_device("cpu")
        ref_kv = clone_kv(kv)
        with torch.inference_mode():
            want = model(ids, pos, meta, ref_kv, last, num_layers=2)
            counter = CountOps()
            pause_in_replays(runner, counter)
            with counter:
                got = fwd.run_host(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if num_ops is not None:  # the upload, plus the index select of each row's last token
            assert counter.ops[0] == "aten.copy_.default" and len(counter.ops) == num_ops
    assert runner.num_replays == 2 and fwd.num_eager_calls == 1 and runner.num_eager_fallbacks == 0


def test_find_bucket_uses_the_smallest_fit():
    model = tiny_model()
    runner = GraphRunner(model, model.allocate_kv_cache(8, BLOCK), [(1, 1), (4, 4), (2, 6, 3)], WIDTH,
                         emulate=True, progress=False)  # fmt: skip
    assert runner.find_bucket(3, 3, 1)[0] == GraphBucket(4, 4, 1)
    assert runner.find_bucket(2, 5, 3)[0] == GraphBucket(2, 6, 3)
    assert runner.find_bucket(1, 1, 1, width=WIDTH + 1)[1] == "context above captured"
