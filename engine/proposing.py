"""What the engine asks of its proposers each decode step, for batches that may mix proposers: each
request's cap (the proposer's peek), the policy's per-request view, and the drafts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from specsched.engine.components import merge_proposals
from specsched.engine.request import Request
from specsched.policies.acceptance import AcceptanceEstimator
from specsched.policies.base import RequestView
from specsched.proposers.base import Proposals, Proposer


def by_proposer(names: Sequence[str]) -> dict[str, Sequence[int]]:
    """Batch indices per proposer name, names in sorted order."""
    if len(set(names)) == 1:
        return {names[0]: range(len(names))}
    by: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        by.setdefault(n, []).append(i)
    return dict(sorted(by.items()))


def peek_caps(proposers: Mapping[str, Proposer], reqs: list[Request], names: Sequence[str]) -> list[int]:
    """Each request's proposer's ``peek``: how many tokens it could draft now (batch order)."""
    by = by_proposer(names)
    if len(by) == 1:  # one proposer for the whole batch: its peek is in batch order
        return list(proposers[names[0]].peek(reqs).max_k)
    peek = [0] * len(reqs)
    for n, idx in by.items():
        for i, m in zip(idx, proposers[n].peek([reqs[i] for i in idx]).max_k):
            peek[i] = m
    return peek


def request_views(
    reqs: list[Request], names: Sequence[str], peek: Sequence[int], acceptance: AcceptanceEstimator,
    max_k: int, max_model_len: int,
) -> list[RequestView]:  # fmt: skip
    """The policy's view of each request: its cap = min(peek, ``spec.max_k``, tokens left before
    max_tokens and the context, the request's own ``spec.max_k``), and its acceptance estimate."""
    if len(set(names)) == 1:  # one proposer: its prior's terms looked up once for the batch
        estimates = acceptance.mean_std_many([r.request_id for r in reqs], names[0]) if reqs else []
    else:
        estimates = list(map(acceptance.mean_std, [r.request_id for r in reqs], names))
    views = []
    for r, n, m, (mean, std) in zip(reqs, names, peek, estimates):
        num_out = len(r.output_ids)
        num_tokens = len(r.prompt_ids) + num_out  # r.num_tokens (one property call less per request)
        cap = r.sampling.max_tokens - num_out - 1  # the min of the four below, without min()'s call
        if m < cap:
            cap = m
        if max_k < cap:
            cap = max_k
        if max_model_len - num_tokens < cap:
            cap = max_model_len - num_tokens
        spec_max = r.spec.max_k
        if spec_max is not None and spec_max < cap:
            cap = spec_max
        views.append(
            RequestView(
                r.request_id, num_tokens, n, cap if cap > 0 else 0, mean, std, r.last_k, r.last_accepted
            )
        )
    return views


def propose(
    proposers: Mapping[str, Proposer], reqs: list[Request], ks: list[int], names: Sequence[str],
    vocab_size: int, device: torch.device,
) -> Proposals:  # fmt: skip
    """Each request's drafts from its proposer, merged in batch order; a plan that drafts nothing (a
    run of plain steps) calls no proposer (each would only loop over the batch to draft nothing:
    0.3 ms a step at batch 64 with the synthetic proposer, H100 2026-12-05)."""
    if not any(ks):
        return Proposals.from_lists([[] for _ in reqs])
    by = by_proposer(names)
    if len(by) == 1:  # one proposer for the whole batch: its proposals as they are
        return proposers[names[0]].propose(reqs, ks)
    parts = [
        (idx, proposers[n].propose([reqs[i] for i in idx], [ks[i] for i in idx])) for n, idx in by.items()
    ]
    return merge_proposals(parts, len(reqs), vocab_size, device)
