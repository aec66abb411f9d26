"""Draft-model proposer: a smaller model (or the target's first L layers) proposes k tokens.

The draft keeps its own paged KV cache, indexed by the request's block table (same slots as the
target, separate tensors), and tracks ``req.num_draft_computed``. Each propose call first *catches
up*: it feeds every token the draft has not seen (the prompt after prefill, or the accepted drafts +
bonus token of the last step) as one varlen row, whose last position gives draft 1; drafts 2..k are
single-token steps. After verification, ``on_commit`` rolls the draft's KV back by length to the
committed prefix, so partial acceptance never leaves stale KV in use.

A self-draft (the target's first L layers) shares the target's cache of those layers instead
(``is_shared_kv``, ``draft.shared_kv``): the same weights over the same tokens give the same K/V, so
every position the target has computed (``req.num_computed``: the prompt after prefill, every
committed token but the last after a step) is already the draft's, and the catch-up feeds only what
the target has not: the last committed token. The draft writes only positions from there on, which
the target's scoring of this step overwrites (in every layer, before its attention reads them) and
which are past the committed prefix otherwise: the target never reads a K/V the draft wrote, so its
logits are unchanged bit for bit. (On the H200 a new request's first propose spent 3-5 ms catching
the separate cache up over its prompt, 2026-12-05.)

For sampled requests the drafts are drawn from q = the draft's distribution under the request's own
temperature/top-k/top-p, and q is returned for rejection sampling (Leviathan et al. 2023).
"""

from __future__ import annotations

import numpy as np
import torch

from specsched.engine.request import Request
from specsched.kernels.sampling import SamplingTensors, logits_to_probs, sample_from_probs
from specsched.models.graph_buckets import HostInputs
from specsched.models.llama import KVCache, LlamaForCausalLM
from specsched.proposers.base import Proposals, Proposer
from specsched.scorers.inputs import chunk_host_inputs, decode_host_inputs, tokens_from


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        block_size: int,
        num_layers: int | None = None,
        is_shared_kv: bool = False,  # kv_cache is the target's (its first num_layers layers)
    ) -> None:
        if is_shared_kv and num_layers is None:
            raise ValueError("a draft sharing the target's KV cache must be the target's first layers")
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.num_layers = num_layers
        self.is_shared_kv = is_shared_kv
        self.device = model.lm_head.weight.device
        self.graph_forward = None  # set by scorers.graph.attach_draft_graphs (CUDA graphs)
        # drafts 2..k of a greedy propose in one replay (models/draft_loop.py, draft.loop_graphs)
        self.loop_graphs = None
        self.is_loop_used = True  # False: the step-by-step path with loop graphs captured (A/B runs)

    def draft_model(self) -> tuple[LlamaForCausalLM, KVCache]:
        return self.model, self.kv_cache

    def _forward(self, reqs: list[Request], tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Feed ``tokens[i]`` at positions ``starts[i]..``; logits at each row's last token. The
        inputs travel in one host-to-device copy (into the graph runner's buffer when it has one)."""
        return self._run(chunk_host_inputs(tokens, starts, [r.block_table for r in reqs], self.block_size))

    def _run(self, x: HostInputs, device_ids: torch.Tensor | None = None) -> torch.Tensor:  # [rows, vocab]
        if self.graph_forward is not None:
            return self.graph_forward.run_host(x, device_ids)
        ids, pos, meta, last = x.to_device(self.device, device_ids, pad_tokens=self.device.type == "cuda")
        return self.model(ids, pos, meta, self.kv_cache, last, num_layers=self.num_layers)

    def _propose_greedy(self, batch: list[Request], k: list[int]) -> Proposals:
        """Greedy drafts without a host read: each step's argmax stays on the device and feeds the
        next step's input ids there (a scatter in the runner's buffer); the drafts are returned on
        the device, request-major, and verification reads them with the target's argmaxes."""
        active = [i for i, ki in enumerate(k) if ki > 0]
        if not active:
            return Proposals.from_lists([[] for _ in batch])
        reqs = [batch[i] for i in active]
        starts = self._starts(reqs)
        tokens = [tokens_from(r, s) for r, s in zip(reqs, starts)]
        x = chunk_host_inputs(tokens, starts, [r.block_table for r in reqs], self.block_size)
        tables, num_blocks = (
            x.block_tables,
            np.fromiter((len(r.block_table) for r in reqs), np.int64, len(reqs)),
        )
        is_loop = self.loop_graphs is not None and self.is_loop_used
        if is_loop and self.is_shared_kv and all(len(t) == 1 for t in tokens):
            # a catch-up of one token (the last committed one) is a step like the others: the whole
            # propose in one replay
            first = np.fromiter((t[0] for t in tokens), np.int64, len(tokens))
            num_steps = np.fromiter((k[i] for i in active), np.int64, len(active))
            out = self._propose_looped(batch, k, active, first, np.asarray(starts, np.int64), num_steps,
                                       tables, num_blocks)  # fmt: skip
            if out is not None:
                return out
            is_loop = False  # the batch does not fit the graphs: step by step (one miss counted)
        tok = self._run(x).argmax(-1)  # [A] on the device
        for r in reqs:
            r.num_draft_computed = r.num_tokens
        if is_loop:
            positions = np.fromiter((r.num_tokens for r in reqs), np.int64, len(reqs))
            num_steps = np.fromiter((k[i] - 1 for i in active), np.int64, len(active))
            out = self._propose_looped(batch, k, active, tok, positions, num_steps, tables, num_blocks)
            if out is not None:
                return out
        rows = np.arange(len(active))  # the step-0 rows that run the current step
        steps = [(active, tok)]  # per draft step: the batch indices it ran, their tokens on the device
        for step in range(1, max(k[i] for i in active)):
            prev, prev_tok = steps[-1]
            keep = np.fromiter((k[i] > step for i in prev), bool, len(prev))
            active = [i for i, kept in zip(prev, keep) if kept]
            rows = rows[keep]
            positions = np.fromiter((batch[i].num_draft_computed for i in active), np.int64, len(active))
            x = decode_host_inputs(positions, tables[rows], num_blocks[rows], self.block_size)
            x.scatter_index = np.arange(len(active))
            x.gather_index = None if keep.all() else np.flatnonzero(keep)
            tok = self._run(x, prev_tok).argmax(-1)
            for i in active:
                batch[i].num_draft_computed += 1
            steps.append((active, tok))
        num_draft = [max(ki, 0) for ki in k]
        flat = torch.cat([t for _, t in steps]) if len(steps) > 1 else steps[0][1]  # step-major
        if len(steps) > 1 and len(steps[0][0]) > 1:  # reorder to request-major (host-known order)
            offsets = np.cumsum([0] + [len(a) for a, _ in steps])
            row_of = [{i: j for j, i in enumerate(a)} for a, _ in steps]  # batch index -> row, per step
            order = [offsets[s] + row_of[s][i] for i in steps[0][0] for s in range(k[i])]
            index = torch.from_numpy(np.asarray(order, dtype=np.int64)).to(flat.device, non_blocking=True)
            flat = flat.index_select(0, index)
        cu = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(num_draft, out=cu[1:])
        return Proposals(flat, torch.from_numpy(cu), None, num_draft)

    def _propose_looped(
        self,
        batch: list[Request],
        k: list[int],
        active: list[int],
        first: torch.Tensor | np.ndarray,  # [A] int64: draft 1 on the device, or the last tokens (host)
        positions: np.ndarray,  # [A] int64: the position of that token
        num_steps: np.ndarray,  # [A] int64: the forwards each active request runs
        tables: np.ndarray,  # [A, w] int32
        num_blocks: np.ndarray,  # [A] int
    ) -> Proposals | None:
        """The active requests' drafts from one replay of the draft loop graphs (models/draft_loop.py):
        drafts 2..k after the catch-up's draft 1 (``first`` on the device), or all k from the last
        committed tokens (``first`` on the host). None when the batch does not fit the graphs (or
        runs no step): the step-by-step path runs instead. The drafts come back request-major, as the
        step-by-step path returns them."""
        if not num_steps.any():  # k = 1 everywhere after the catch-up: draft 1 is all
            return None
        rest = self.loop_graphs.run(first, positions, tables, num_blocks, num_steps)  # [S, A]
        if rest is None:
            return None
        for i, p, n in zip(active, positions.tolist(), num_steps.tolist()):
            batch[i].num_draft_computed = p + n
        tokens = rest if isinstance(first, np.ndarray) else torch.cat([first[None], rest])  # [max k, A]
        if min(k[i] for i in active) == max(k[i] for i in active):  # one k: request-major by a transpose
            flat = tokens.T.reshape(-1)
        else:
            num_active = len(active)
            order = [s * num_active + j for j, i in enumerate(active) for s in range(k[i])]  # request-major
            index = torch.from_numpy(np.asarray(order, dtype=np.int64)).to(tokens.device, non_blocking=True)
            flat = tokens.reshape(-1).index_select(0, index)
        num_draft = [max(ki, 0) for ki in k]
        cu = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(num_draft, out=cu[1:])
        return Proposals(flat, torch.from_numpy(cu), None, num_draft)

    def _starts(self, reqs: list[Request]) -> list[int]:
        """Where each request's catch-up starts: the first position the draft's cache lacks (with a
        shared cache, also past every position the target has computed)."""
        if self.is_shared_kv:
            return [max(r.num_draft_computed, r.num_computed) for r in reqs]
        return [r.num_draft_computed for r in reqs]

    def _pick(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next draft token per row: argmax for greedy requests, a sample from q otherwise."""
        if all(r.sampling.is_greedy for r in reqs):
            return logits.argmax(-1), None
        st = SamplingTensors.from_params([r.sampling for r in reqs], None, logits.device)
        probs = logits_to_probs(logits, st)  # greedy rows are one-hot
        u = torch.stack([torch.rand((), generator=r.generator) for r in reqs]).to(
            logits.device, non_blocking=True
        )
        return sample_from_probs(probs, u), probs

    @torch.inference_mode()
    def propose(self, batch: list[Request], k: list[int]) -> Proposals:
        if all(r.sampling.is_greedy for r in batch):
            return self._propose_greedy(batch, k)
        active = [i for i, ki in enumerate(k) if ki > 0]
        drafts: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        any_probs = False
        if active:
            reqs = [batch[i] for i in active]
            starts = self._starts(reqs)
            logits = self._forward(reqs, [tokens_from(r, s) for r, s in zip(reqs, starts)], starts)
            for r in reqs:
                r.num_draft_computed = r.num_tokens
            for step in range(max(k[i] for i in active)):
                if step > 0:
                    active = [i for i in active if k[i] > step]
                    reqs = [batch[i] for i in active]
                    logits = self._forward(
                        reqs, [[drafts[i][-1]] for i in active], [r.num_draft_computed for r in reqs]
                    )
                    for r in reqs:
                        r.num_draft_computed += 1
                tok, q = self._pick(logits, reqs)
                for row, (i, t) in enumerate(zip(active, tok.tolist())):  # one host copy per draft step
                    drafts[i].append(t)
                    if q is not None and not batch[i].sampling.is_greedy:
                        probs[i].append(q[row])
                any_probs |= q is not None
        out = Proposals.from_lists(drafts)  # on the host: the drafts were read there already
        if any_probs:
            vocab = self.model.cfg.vocab_size
            rows = []
            for i, d in enumerate(drafts):
                for j, t in enumerate(d):
                    if batch[i].sampling.is_greedy:  # q is unused for greedy rows: one-hot
                        rows.append(
                            torch.nn.functional.one_hot(
                                torch.tensor(t).to(self.device, non_blocking=True), vocab
                            ).float()
                        )
                    else:
                        rows.append(probs[i][j])
            out.draft_probs = torch.stack(rows) if rows else None
        return out

    def on_commit(self, batch: list[Request]) -> None:
        for r in batch:
            r.num_draft_computed = min(r.num_draft_computed, r.num_tokens - 1)
