"""A greedy draft's single-token steps in one CUDA graph replay (``draft.loop_graphs``).

A greedy propose (proposers/draft.py) runs the draft model's catch-up forward, whose argmax is each
request's draft 1, then single-token forwards for drafts 2..k, each fed the argmax of the one before.
Launched one at a time, every one of those steps costs the host an input build, an upload and a
graph launch: for a small draft the loop is host-bound (H100, 2026-12-07: the 7B pair's 68M draft at
batch 4, k = 8, seven such steps a propose, whose host time moved by 0.24-0.41 ms with what the host
did before them; docs/benchmarks.md).

Here steps 2..k run as one graph per (rows bucket, number of steps): step s + 1's inputs are computed
on the device from step s's — its argmax as the ids, positions + 1, the K/V slot looked up in the
block table — so one upload (each row's first position, its block table and its number of steps)
and one replay run all of them. A row with fewer steps than the graph (k below the batch's largest)
stops in place: from its last step on its position stays, its K/V goes to the pad slot and its tokens
are not read. A self-draft on the target's KV cache (``draft.shared_kv``) catches up over one token,
the last committed one, a single-token step like the others: its whole propose is one replay (drafts
1..k from the committed tokens, uploaded with the rest). :func:`draft_steps` is the loop itself
(eager on any device, the reference the tests compare with the step-by-step path);
:class:`DraftLoopGraphs` captures it per (rows, steps) on CUDA (``emulate``: replays re-run it, for
CPU tests)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch
from tqdm.auto import tqdm

from specsched.kernels.metadata import AttentionMetadata
from specsched.models.graph_buckets import PAD_SLOT
from specsched.models.graph_capture import (
    CaptureMemory,
    EagerReplay,
    Staging,
    capture_graph,
    captured_backend,
)
from specsched.models.llama import KVCache, LlamaForCausalLM

logger = logging.getLogger(__name__)


def draft_steps(
    model: LlamaForCausalLM,
    kv_cache: KVCache,
    ids: torch.Tensor,  # [R] int64: each row's first input token (draft 1, or the last committed one)
    positions: torch.Tensor,  # [R] int64: the position of that token
    block_tables: torch.Tensor,  # [R, W] int32
    num_steps: torch.Tensor,  # [R] int64: forwards this row runs (0: a pad row)
    out: torch.Tensor,  # [S, >= R] int64: step s's argmax of row r at out[s, r]
    block_size: int,
    max_k: int,  # keys a row may attend to at most (the metadata's host bound)
    num_layers: int | None = None,
) -> None:
    """``out.shape[0]`` single-token forwards of the draft, each fed the last one's argmax, with every
    input computed on the device (nothing read on the host, so the loop can be captured). Row r's
    step s (s < ``num_steps[r]``) stores its K/V at position ``positions[r] + s`` as the step-by-step
    path does; past its steps a row reruns its last position with its K/V sent to the pad slot."""
    rows = ids.shape[0]
    cu = torch.arange(rows + 1, dtype=torch.int32, device=ids.device)
    pos, width = positions, block_tables.shape[1]
    for s in range(out.shape[0]):
        is_live = num_steps > s  # [R] bool
        block = (pos // block_size).clamp_(max=width - 1)
        slot = block_tables.gather(1, block[:, None])[:, 0].to(torch.int64) * block_size + pos % block_size
        slot = torch.where(is_live, slot, torch.full_like(slot, PAD_SLOT))
        meta = AttentionMetadata(cu, (pos + 1).to(torch.int32), block_tables, slot, 1, max_k)
        ids = model(ids, pos, meta, kv_cache, None, num_layers).argmax(-1)
        out[s, :rows].copy_(ids)
        pos = pos + is_live.to(torch.int64)  # a finished row stays on its last position


class DraftLoopGraphs:
    """:func:`draft_steps` captured per (rows bucket, steps): ``rows`` the bucket sizes (the draft's
    decode ladder), steps 1..``max_steps`` (spec.max_k: a shared-cache self-draft's whole propose)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        rows: Iterable[int],
        max_steps: int,
        max_blocks_per_row: int,
        num_layers: int | None = None,
        *,
        graph_backend: str | None = "triton",
        emulate: bool = False,
        progress: bool = True,
        num_warmup: int = 1,
    ) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.device = model.lm_head.weight.device
        self.is_emulated = emulate
        if self.device.type != "cuda" and not emulate:
            raise ValueError(f"draft loop graphs need the model on CUDA, not {self.device} (emulate: tests)")
        if max_steps < 1:
            raise ValueError(f"draft loop graphs need max_steps >= 1, got {max_steps}")
        self.rows = sorted(set(rows))
        if not self.rows or self.rows[0] < 1:
            raise ValueError(f"draft loop graphs need row buckets >= 1, got {self.rows}")
        self.num_layers = num_layers or model.cfg.num_layers
        self.max_steps, self.width = max_steps, max_blocks_per_row
        self.block_size = kv_cache[0][0].shape[1]
        self.max_k = max_blocks_per_row * self.block_size
        self.num_warmup = num_warmup
        self.num_replays = 0
        self.num_misses = 0  # proposes that did not fit (more rows or steps than captured): step by step
        self.capture_s = 0.0
        self.graph_memory_bytes = 0
        r = self.rows[-1]
        # one static byte buffer, [first ids R | positions R | steps R] int64 then [R, W] int32 block
        # tables: a bucket of b rows reads the first b of each, and its upload is the prefix up to its
        # tables
        self._tables_at = 24 * r
        nbytes = self._tables_at + 4 * r * self.width
        self._staging = Staging(nbytes, self.device)
        with torch.inference_mode():
            self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)  # [bytes]
            self.out = torch.zeros(max_steps, r, dtype=torch.int64, device=self.device)  # [S, R]
        self._pool = None if emulate else torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | EagerReplay] = {}
        self._capture_all(graph_backend, progress)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def stats(self) -> dict:
        return {"name": "draft loop", "num_graphs": self.num_graphs, "capture_s": round(self.capture_s, 2),
                "graph_memory_mib": round(self.graph_memory_bytes / 2**20, 1),
                "num_replays": self.num_replays, "num_misses": self.num_misses}  # fmt: skip

    def _views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(first ids, positions, steps [rows] int64, block tables [rows, W] int32) of the buffer."""
        r, buf = self.rows[-1], self.buffer
        ids, pos, steps = (buf[8 * r * j : 8 * r * (j + 1)].view(torch.int64)[:rows] for j in range(3))
        tables = buf[self._tables_at :].view(torch.int32).view(r, self.width)[:rows]
        return ids, pos, steps, tables

    def _loop_fn(self, rows: int, steps: int) -> Callable[[], None]:
        ids, pos, num_steps, tables = self._views(rows)
        out = self.out[:steps]

        def loop() -> None:
            draft_steps(self.model, self.kv_cache, ids, pos, tables, num_steps, out, self.block_size,
                        self.max_k, self.num_layers)  # fmt: skip

        return loop

    def _capture_all(self, graph_backend: str | None, progress: bool) -> None:
        t0 = time.perf_counter()
        stream = None if self.is_emulated else torch.cuda.Stream(device=self.device)
        shapes = [(r, s) for r in reversed(self.rows) for s in range(self.max_steps, 0, -1)]
        desc = "capturing draft loop graphs" + (" (emulated)" if self.is_emulated else "")
        # the buffer is all zeros while capturing: pad rows, every K/V to the pad slot
        with (
            captured_backend(self.model, graph_backend, self.is_emulated),
            torch.inference_mode(),
            CaptureMemory(self.device) as memory,
        ):
            for r, s in tqdm(shapes, desc=desc, disable=not progress, unit="graph"):
                fn = self._loop_fn(r, s)
                self._graphs[r, s] = (
                    EagerReplay(fn)
                    if self.is_emulated
                    else capture_graph(fn, self.device, self._pool, stream, self.num_warmup)
                )
        self.graph_memory_bytes = memory.bytes
        self.capture_s = time.perf_counter() - t0
        logger.info("draft loop: captured %d graphs (rows up to %d, steps up to %d) in %.1f s, %.1f MiB",
                    self.num_graphs, self.rows[-1], self.max_steps, self.capture_s,
                    self.graph_memory_bytes / 2**20)  # fmt: skip

    @torch.inference_mode()
    def run(
        self,
        first: torch.Tensor | np.ndarray,  # [A] int64: each row's first input token (device or host)
        positions: np.ndarray,  # [A] int64: the position of that token
        block_tables: np.ndarray,  # [A, w] int32, rows padded with 0
        num_blocks: np.ndarray,  # [A] int: real blocks of each row's table
        num_steps: np.ndarray,  # [A] int: forwards per row, >= 0
    ) -> torch.Tensor | None:  # [S, A] int64, S = max(num_steps): a view, valid until the next run
        """Each row's next tokens (step s's of row a at ``[s, a]``, read below ``num_steps[a]``) from
        one upload and one replay: drafts 2.. after a catch-up forward whose argmaxes are ``first``
        (on the device), or every draft from the last committed tokens (``first`` on the host: a
        self-draft on the target's cache, whose catch-up is that one token). None when the batch does
        not fit the graphs (more rows or steps than captured, a block table wider than captured, or a
        row whose steps would leave its blocks: the caller's step-by-step path then runs, and raises
        where it should)."""
        a, w = len(positions), block_tables.shape[1]
        s = int(num_steps.max(initial=0))
        r = next((b for b in self.rows if b >= a), None)
        last = (positions + np.maximum(num_steps, 1) - 1) // self.block_size
        if r is None or not 1 <= s <= self.max_steps or w > self.width or (last >= num_blocks).any():
            self.num_misses += 1
            return None
        i = self._staging.acquire()
        host = self._staging.arrays[i]
        big = self.rows[-1]
        host[: 24 * big].view(np.int64)[:] = 0
        is_host_first = isinstance(first, np.ndarray)
        if is_host_first:
            host[: 8 * big].view(np.int64)[:a] = first
        host[8 * big : 16 * big].view(np.int64)[:a] = positions
        host[16 * big : 24 * big].view(np.int64)[:a] = num_steps
        n = self._tables_at + 4 * r * self.width  # the upload: the bucket's prefix of the buffer
        tables = host[self._tables_at : n].view(np.int32).reshape(r, self.width)
        tables[:] = 0
        tables[:a, :w] = block_tables
        self.buffer[:n].copy_(self._staging.host[i][:n], non_blocking=True)
        self._staging.copied(i)
        if not is_host_first:
            self._views(a)[0].copy_(first)
        self._graphs[r, s].replay()
        self.num_replays += 1
        return self.out[:s, :a]
