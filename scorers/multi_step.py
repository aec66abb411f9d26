"""Plain decode steps run back to back on the device: each step's argmax is the next step's input.

A step whose plan drafts nothing for any request (k_i = 0 for all, every request greedy) can run
``S`` target forwards in a row without reading anything on the host in between: step ``s`` feeds
request i's token at position ``n_i - 1 + s`` (``n_i = req.num_tokens`` before the step), its id the
argmax of step ``s - 1`` (scattered into the uploaded ids on the device, as a device-side proposer's
drafts are), and writes that position's K/V. The host reads the ``[S, B]`` tokens once, at the end.
This is vLLM's multi-step scheduling (``num_scheduler_steps``): the host's per-step work (schedule,
decide, inputs, the host read, commit, streaming, the log) is paid once per ``S`` tokens instead of
once per token. Each forward is the one a single plain step runs (same rows, same bucket), so the
tokens are the ones ``S`` single greedy steps give; tokens after a stop are dropped at the commit
(their K/V, past the request's end, is never read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from specsched.engine.request import Request
from specsched.models.graph_buckets import HostInputs
from specsched.proposers.base import Proposals
from specsched.scorers.inputs import decode_host_inputs
from specsched.scorers.metadata_gpu import ScoringBatch, pack_scoring_batch

# a forward from host inputs: (inputs, the ids at inputs.scatter_index on the device, or None) ->
# logits whose first rows are the inputs' rows, [>= rows, vocab]
HostForward = Callable[[HostInputs, "torch.Tensor | None"], torch.Tensor]


def decode_step_inputs(sb: ScoringBatch, num_blocks: np.ndarray, step: int) -> HostInputs:
    """Step ``step`` (0-based) of a run of plain decode steps: one row per request, its token at
    position ``n_i - 1 + step``; at step 0 the ids are the requests' last tokens, later ones come from
    the device (``scatter_index`` = every row). ``num_blocks`` [B]: each request's real blocks (a
    position past them raises)."""
    x = decode_host_inputs(sb.num_tokens - 1 + step, sb.block_tables, num_blocks, sb.block_size)
    if step == 0:
        return replace(x, input_ids=sb.last_tokens.astype(np.int64, copy=True))
    return replace(x, scatter_index=np.arange(sb.num_requests, dtype=np.int64))


def greedy_decode_steps(
    forward: HostForward,
    batch: list[Request],
    num_steps: int,
    block_size: int,
    device: torch.device,
    on_first_launch: Callable[[], None] | None = None,
) -> torch.Tensor:  # [num_steps, B] int64 on device
    """Run ``num_steps`` greedy plain decode steps of ``batch`` with ``forward`` (a scorer's
    ``decode_forward``); returns each step's argmax token per request, on the device (no host read).
    Every request's block table must already cover ``num_tokens + num_steps - 1`` positions.
    ``on_first_launch`` is called once the first step is queued (with more than one step), while the
    host still launches the others: from there on the device has work."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    b = len(batch)
    zero = Proposals.from_lists([[] for _ in range(b)], device="cpu")
    sb = pack_scoring_batch(batch, zero, block_size)
    num_blocks = np.fromiter((len(r.block_table) for r in batch), dtype=np.int64, count=b)
    out = torch.empty((num_steps, b), dtype=torch.int64, device=device)
    prev: torch.Tensor | None = None
    for s in range(num_steps):
        logits = forward(decode_step_inputs(sb, num_blocks, s), prev)  # [>= B, vocab]
        torch.argmax(logits[:b], dim=-1, out=out[s])  # the argmax verify_greedy takes
        prev = out[s]
        if s == 0 and num_steps > 1 and on_first_launch is not None:
            on_first_launch()
    return out
