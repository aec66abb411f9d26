"""Vectorised scoring inputs == the host-loop reference; graph padding keeps the real rows intact."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specsched.engine.request import Request, SamplingParams
from specsched.models.graph_buckets import PAD_SLOT, pad_inputs, token_bucket
from specsched.proposers.base import Proposals
from specsched.scorers.inputs import build_scoring_inputs
from specsched.scorers.metadata_gpu import build_scoring_inputs_vec, pack_scoring_batch

BLOCK = 4
VOCAB = 256


def ragged_batch(rng: random.Random, num: int, spare_blocks: int = 0) -> tuple[list[Request], Proposals]:
    """Decoding requests with random lengths, ragged k (0 included), scattered block tables."""
    free = list(range(1, 4000))
    rng.shuffle(free)
    reqs, drafts = [], []
    for i in range(num):
        n = rng.randint(1, 60)
        k = rng.choice([0, rng.randint(0, 8), 8])
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, n))]
        output = [rng.randrange(VOCAB) for _ in range(n - len(prompt))]
        need = -(-(n + k) // BLOCK) + rng.randint(0, spare_blocks)
        table = [free.pop() for _ in range(need)]
        r = Request(f"r{i}", prompt, SamplingParams(), output_ids=output, block_table=table)
        r.num_computed = n - 1
        reqs.append(r)
        drafts.append([rng.randrange(VOCAB) for _ in range(k)])
    return reqs, Proposals.from_lists(drafts)


def assert_same_inputs(got, want, padded: bool = False) -> None:
    """``got`` equals ``want``; with ``padded`` (CUDA) its tokens are padded to the token bucket:
    the real ones first, the pad ones id 0 at position 0 writing to the pad slot."""
    t = want.num_tokens
    assert got.num_tokens == (token_bucket(t) if padded else t)
    for name in ("input_ids", "positions"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a[:t].cpu(), b.cpu()), name
        assert not a[t:].any(), name
    assert (got.meta.slot_mapping[t:] == PAD_SLOT).all()
    for name in ("cu_seqlens_q", "seq_lens_k", "block_tables", "slot_mapping"):
        a, b = getattr(got.meta, name), getattr(want.meta, name)
        a = a[:t] if name == "slot_mapping" else a
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        assert torch.equal(a.cpu(), b.cpu()), f"{name}: {a} vs {b}"
    assert (got.meta.max_q, got.meta.max_k) == (want.meta.max_q, want.meta.max_k)


@pytest.mark.parametrize("is_expanded", [False, True], ids=["mqa", "expanded"])
@pytest.mark.parametrize("seed", range(8))
def test_vectorised_inputs_equal_reference(seed, is_expanded):
    rng = random.Random(seed)
    num = rng.randint(1, 12) if seed < 6 else rng.randint(32, 80)  # large batches: tables padded by a mask
    reqs, props = ragged_batch(rng, num, spare_blocks=2)
    want = build_scoring_inputs(reqs, props, BLOCK, torch.device("cpu"), is_expanded=is_expanded)
    sb = pack_scoring_batch(reqs, props, BLOCK)
    got = build_scoring_inputs_vec(sb, props.draft_tokens, "cpu", is_expanded=is_expanded)
    assert_same_inputs(got, want)
    assert sb.num_rows(is_expanded) == want.meta.num_rows
    assert sb.total_tokens == want.num_tokens


def test_no_drafts_at_all():
    reqs, props = ragged_batch(random.Random(9), 5)
    props = Proposals.from_lists([[] for _ in reqs])
    for is_expanded in (False, True):
        want = build_scoring_inputs(reqs, props, BLOCK, torch.device("cpu"), is_expanded=is_expanded)
        got = build_scoring_inputs_vec(pack_scoring_batch(reqs, props, BLOCK), props.draft_tokens, "cpu",
                                       is_expanded=is_expanded)  # fmt: skip
        assert_same_inputs(got, want)


def test_pack_rejects_bad_batches():
    reqs, props = ragged_batch(random.Random(3), 3)
    with pytest.raises(ValueError, match="proposals cover 2 requests, batch has 3"):
        pack_scoring_batch(reqs, Proposals.from_lists([[1], [2]]), BLOCK)
    reqs[1].num_computed -= 1
    with pytest.raises(RuntimeError, match="request r1 is not decoding"):
        pack_scoring_batch(reqs, props, BLOCK)
    reqs[1].num_computed += 1
    reqs[2].block_table = reqs[2].block_table[:-1]
    with pytest.raises(ValueError, match="request r2: its block table"):
        pack_scoring_batch(reqs, props, BLOCK)


def test_draft_count_mismatch_is_an_error():
    reqs, props = ragged_batch(random.Random(4), 3)
    sb = pack_scoring_batch(reqs, props, BLOCK)
    with pytest.raises(ValueError, match="draft_tokens must be"):
        extra = torch.zeros(props.num_tokens + 1, dtype=torch.int64)
        build_scoring_inputs_vec(sb, extra, "cpu", is_expanded=False)


@pytest.mark.parametrize("seed", range(4))
def test_pad_inputs_layout(seed):
    rng = random.Random(seed)
    reqs, props = ragged_batch(rng, rng.randint(1, 6))
    x = build_scoring_inputs(reqs, props, BLOCK, torch.device("cpu"), is_expanded=False)
    r, t, w = x.meta.num_rows, x.num_tokens, x.meta.block_tables.shape[1]
    rows, tokens, width = r + rng.randint(0, 5), t + rng.randint(0, 7), w + rng.randint(0, 3)
    ids, pos, meta = pad_inputs(x.input_ids, x.positions, x.meta, rows, tokens, width, 9, 99)
    assert (ids.shape[0], pos.shape[0], meta.num_rows, meta.num_tokens) == (tokens, tokens, rows, tokens)
    assert (meta.max_q, meta.max_k) == (9, 99)
    # real part untouched
    assert torch.equal(ids[:t], x.input_ids) and torch.equal(pos[:t], x.positions)
    assert torch.equal(meta.cu_seqlens_q[: r + 1], x.meta.cu_seqlens_q)
    assert torch.equal(meta.seq_lens_k[:r], x.meta.seq_lens_k)
    assert torch.equal(meta.block_tables[:r, :w], x.meta.block_tables)
    assert torch.equal(meta.slot_mapping[:t], x.meta.slot_mapping)
    # padding: ids/positions 0, KV into the pad block, zero block-table entries
    assert not ids[t:].any() and not pos[t:].any()
    assert (meta.slot_mapping[t:] == PAD_SLOT).all()
    assert not meta.block_tables[r:].any() and not meta.block_tables[:, w:].any()
    q_lens = meta.cu_seqlens_q.diff()
    pad_q = q_lens[r:]
    owned = min(rows - r, tokens - t)
    assert pad_q[:owned].eq(1).all() and pad_q[owned:].eq(0).all()
    assert torch.equal(meta.seq_lens_k[r:], pad_q)  # a pad row sees exactly its own pad token
    assert int(meta.cu_seqlens_q[-1]) == t + owned <= tokens
    assert meta.cu_seqlens_q.dtype == torch.int32 and meta.seq_lens_k.dtype == torch.int32


def test_pad_inputs_rejects_shrinking():
    reqs, props = ragged_batch(random.Random(5), 3)
    x = build_scoring_inputs(reqs, props, BLOCK, torch.device("cpu"), is_expanded=False)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_inputs(x.input_ids, x.positions, x.meta, 2, x.num_tokens, 99, 9, 99)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("is_expanded", [False, True], ids=["mqa", "expanded"])
def test_vectorised_inputs_on_cuda_equal_reference(is_expanded):
    rng = random.Random(11)
    reqs, props = ragged_batch(rng, 40, spare_blocks=3)
    want = build_scoring_inputs(reqs, props, BLOCK, torch.device("cpu"), is_expanded=is_expanded)
    got = build_scoring_inputs_vec(
        pack_scoring_batch(reqs, props, BLOCK), props.draft_tokens.cuda(), "cuda", is_expanded=is_expanded
    )
    assert got.input_ids.is_cuda and got.meta.block_tables.is_cuda
    assert_same_inputs(got, want, padded=True)


def test_decode_host_inputs_equal_chunk_inputs_of_one_token_rows():
    from specsched.scorers.inputs import chunk_host_inputs, decode_host_inputs

    rng = random.Random(4)
    tables = [[rng.randrange(1, 500) for _ in range(rng.randint(1, 6))] for _ in range(7)]
    starts = [rng.randrange(len(t) * BLOCK) for t in tables]
    want = chunk_host_inputs([[0]] * len(tables), starts, tables, BLOCK)
    num_blocks = np.array([len(t) for t in tables])
    got = decode_host_inputs(np.array(starts), want.block_tables, num_blocks, BLOCK)
    for name in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "seq_lens_k", "block_tables"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert (got.max_q, got.max_k) == (want.max_q, want.max_k)
    starts[2] = len(tables[2]) * BLOCK  # one past its table
    with pytest.raises(ValueError, match="blocks, has"):
        decode_host_inputs(np.array(starts), want.block_tables, num_blocks, BLOCK)
