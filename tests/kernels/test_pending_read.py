"""Verification queued now and read later (``launch_*`` + ``result()``): the launch takes what it needs
from the logits at once (the engine's overlapped host work may follow before the read), greedy rows
follow the argmax rule, sampled rows equal the verification done at once; the pending read's
readiness."""

from __future__ import annotations

import random

import torch

from specsched.engine.request import SamplingParams
from specsched.kernels.pending_read import PendingRead
from specsched.kernels.rejection_sampling import launch_greedy, launch_verify, verify, verify_greedy
from specsched.proposers.base import Proposals


def random_batch(seed: int, vocab: int = 11):
    rng = random.Random(seed)
    ks = [rng.choice([0, 1, 3, 8]) for _ in range(rng.randrange(1, 9))]
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=torch.Generator().manual_seed(seed))
    # drafts that often match the target's argmax, so that acceptance runs of every length occur
    argmax = logits.argmax(-1).tolist()
    drafts, row = [], 0
    for k in ks:
        drafts.append([argmax[row + j] if rng.random() < 0.7 else rng.randrange(vocab) for j in range(k)])
        row += k + 1
    return logits, Proposals.from_lists(drafts)


def greedy_reference(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    """Greedy verification by its definition, request by request on plain lists."""
    argmax, out, row = logits.argmax(-1).tolist(), [], 0
    for d in drafts:
        a = 0
        while a < len(d) and d[a] == argmax[row + a]:
            a += 1
        out.append(d[:a] + [argmax[row + a]])
        row += len(d) + 1
    return out


def test_launched_greedy_reads_the_logits_of_its_launch():
    for seed in range(20):
        logits, props = random_batch(seed)
        drafts = [
            props.draft_tokens[a:b].tolist() for a, b in zip(props.cu_num_draft, props.cu_num_draft[1:])
        ]
        want = greedy_reference(logits, drafts)
        pending = launch_greedy(logits, props)
        assert isinstance(pending, PendingRead)
        logits.neg_()  # what runs between the launch and the read may reuse the buffer
        got = pending.result()
        assert got.to_lists() == want
        assert got.match_bits() == ["1" * (len(e) - 1) + ("0" if len(e) - 1 < len(d) else "") for e, d in
                                    zip(want, drafts)]  # fmt: skip


def generators(n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(100 + i) for i in range(n)]


def test_launched_mixed_batch_reads_as_verify_with_the_same_generators():
    for seed in range(10):
        logits, props = random_batch(seed)
        n = props.num_requests
        sampling = [SamplingParams(temperature=0.0 if i % 2 else 0.8) for i in range(n)]

        want = verify(logits.clone(), props, sampling, generators(n)).to_lists()
        pending = launch_verify(logits, props, sampling, generators(n))
        logits.neg_()  # what runs between the launch and the read may reuse the buffer
        assert pending.result().to_lists() == want


def test_a_host_tensor_is_never_reported_done():
    # on the host path no event exists: a caller asking whether the device is done is told no (and
    # does what it does while the device works, as before); the result is read all the same
    logits, props = random_batch(3)
    pending = launch_greedy(logits, props)
    assert not pending.is_done
    assert pending.result().num_requests == props.num_requests


def test_then_passes_the_same_read_on():
    logits, props = random_batch(5)
    pending = launch_greedy(logits, props)
    lists = pending.then(lambda r: (r.to_lists(), r.match_bits()))
    assert lists.tensor is pending.tensor and lists.is_done == pending.is_done
    want = verify_greedy(logits, props)
    assert lists.result() == (want.to_lists(), want.match_bits())
