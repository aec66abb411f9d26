"""CUDA graphs of the model forward over (rows, tokens) buckets, with padding and eager fallback.

A :class:`GraphRunner` captures ``model.forward`` once per :class:`GraphBucket` into a
``torch.cuda.CUDAGraph`` that reads its inputs through views of one static byte buffer (laid out per
bucket by :class:`~specsched.models.graph_buckets.InputLayout`; graphs never run concurrently, so
the layouts share the memory) and allocates from one shared memory pool. The logits are copied
inside the graph into a static ``[max_tokens, vocab]`` buffer, so nothing of a graph's own pool
memory stays alive after its capture and the graphs may be replayed in any order. ``run_host`` picks
the smallest bucket that fits the real batch (a
:class:`~specsched.models.graph_buckets.HostInputs`), writes it padded into a host staging buffer
(pinned on CUDA) and uploads it in **one** non-blocking copy into the static device buffer whose
views are that bucket's graph inputs, replays, and returns the real tokens' logits (a view of the
static logits buffer, valid until this runner's next replay). ``run`` is the same for inputs that
are already device tensors (padded on the device: more device ops). A shape
outside every bucket runs the model eagerly; the reason is logged (first time per reason) and
counted (``num_eager_fallbacks``, ``fallback_reasons``), so a miss is never a crash and never a
silently wrong answer.

Buckets, their size ladder and the padding layout are in :mod:`specsched.models.graph_buckets`;
decode buckets also serve a draft model's single-token steps (``scorers.graph.GraphForward``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np
import torch
from tqdm.auto import tqdm

from specsched.kernels.metadata import AttentionMetadata
from specsched.models.graph_buckets import GraphBucket, HostInputs, InputLayout, as_bucket, pad_inputs
from specsched.models.graph_capture import (
    CaptureMemory,
    EagerReplay,
    Staging,
    capture_graph,
    captured_backend,
    graph_stats,
)
from specsched.models.llama import KVCache, LlamaForCausalLM

logger = logging.getLogger(__name__)


class GraphRunner:
    """CUDA graphs of ``model.forward`` (its first ``num_layers`` layers) over ``kv_cache``."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        buckets: Iterable[GraphBucket | tuple[int, int] | tuple[int, int, int]],
        max_blocks_per_row: int,
        num_layers: int | None = None,
        *,
        name: str = "target",
        graph_backend: str | None = "triton",  # attention backend captured (None: the model's own)
        emulate: bool = False,
        progress: bool = True,
        num_warmup: int = 1,
        last_token_logits: bool = False,
    ) -> None:
        """``last_token_logits``: the graphs compute the logits of each row's last token only
        (prefill chunks); ``run_host`` then returns ``[rows, vocab]`` and needs inputs whose
        ``logits_indices`` are exactly every row's last token (what its eager fallback computes)."""
        self.model, self.kv_cache, self.name = model, kv_cache, name
        self.is_last_token_logits = last_token_logits
        self.device = model.lm_head.weight.device
        self.is_emulated = emulate
        if self.device.type != "cuda" and not emulate:
            raise ValueError(
                f"CUDA graphs need the model on a CUDA device, it is on {self.device} "
                f"(emulate=True runs the padding logic eagerly, for tests)"
            )
        self.num_layers = num_layers or model.cfg.num_layers
        if len(kv_cache) < self.num_layers:
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, the graphs run {self.num_layers}")
        if max_blocks_per_row < 1:
            raise ValueError(f"max_blocks_per_row must be >= 1, got {max_blocks_per_row}")
        self.buckets = sorted({as_bucket(b) for b in buckets}, key=lambda b: (b.tokens, b.rows, b.max_q))
        if not self.buckets:
            raise ValueError("GraphRunner needs at least one bucket")
        self.block_size = kv_cache[0][0].shape[1]
        self.max_blocks = max_blocks_per_row
        self.max_k = max_blocks_per_row * self.block_size
        self.num_warmup = num_warmup
        self.num_replays = 0
        self.num_eager_fallbacks = 0
        self.fallback_reasons: Counter[str] = Counter()
        self.graph_memory_bytes = 0
        self.capture_s = 0.0
        # one static byte buffer: bucket b's graph reads its inputs through the views of its own
        # layout (graphs never run concurrently, so the layouts may overlap); the int64 tails after
        # the inputs (logits indices, scatter and gather index) need at most 3 * tokens more
        self.layouts = {b: InputLayout(b.tokens, b.rows, max_blocks_per_row) for b in self.buckets}
        nbytes = max(lay.base_nbytes + 24 * lay.tokens for lay in self.layouts.values())
        with torch.inference_mode():
            self.input_buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)  # [bytes]
            num_logits = self.max_rows if last_token_logits else self.max_tokens
            self.logits = torch.zeros(
                num_logits, model.cfg.vocab_size, dtype=torch.float32, device=self.device
            )  # [T, V] (rows: [R, V])
        self._staging = Staging(nbytes, self.device)
        self._pool = None if emulate else torch.cuda.graph_pool_handle()
        self._warmup_stream: torch.cuda.Stream | None = None
        self._graphs: dict[GraphBucket, torch.cuda.CUDAGraph | EagerReplay] = {}
        self._ids_views: dict[GraphBucket, torch.Tensor] = {}  # [tokens] int64: each graph's input ids
        self._capture_all(graph_backend, progress)

    # ---- shapes ---------------------------------------------------------------------------------
    @property
    def max_rows(self) -> int:
        return max(b.rows for b in self.buckets)

    @property
    def max_tokens(self) -> int:
        return max(b.tokens for b in self.buckets)

    @property
    def max_captured_q(self) -> int:
        return max(b.max_q for b in self.buckets)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def find_bucket(
        self, rows: int, tokens: int, max_q: int, width: int = 1, max_k: int = 0
    ) -> tuple[GraphBucket | None, str, str]:
        """(smallest fitting bucket or None, reason key, detail) for a batch of this shape."""
        if tokens < 1:
            return None, "empty batch", f"{rows} rows, {tokens} tokens"
        if width > self.max_blocks or max_k > self.max_k:
            detail = f"block-table width {width} / max_k {max_k} > captured {self.max_blocks} / {self.max_k}"
            return None, "context above captured", detail
        for b in self.buckets:
            if b.fits(rows, tokens, max_q):
                return b, "", ""
        shape = f"{rows} rows, {tokens} tokens, max_q {max_q}"
        if rows > self.max_rows:
            return None, "rows above largest bucket", f"{shape}; largest {self.max_rows} rows"
        if tokens > self.max_tokens:
            return None, "tokens above largest bucket", f"{shape}; largest {self.max_tokens} tokens"
        if max_q > self.max_captured_q:
            return None, "max_q above captured", f"{shape}; captured max_q {self.max_captured_q}"
        return None, "no bucket fits", shape

    def stats(self) -> dict:
        return {**graph_stats(self), "fallback_reasons": dict(self.fallback_reasons),
                "num_staging_waits": self._staging.num_waits}  # fmt: skip

    # ---- capture --------------------------------------------------------------------------------
    def _views(
        self, lay: InputLayout, max_q: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, tuple[torch.Tensor, ...]]:
        """ids, positions, metadata (views of the static buffer), (logits, scatter, gather index)."""
        ids, pos, slots, cu, seq, tables, *tails = lay.split(self.input_buffer)
        return ids, pos, AttentionMetadata(cu, seq, tables, slots, max_q, self.max_k), tuple(tails)

    def _forward_fn(self, b: GraphBucket) -> Callable[[], None]:
        ids, pos, meta, _ = self._views(self.layouts[b], b.max_q)
        self._ids_views[b] = ids
        if self.is_last_token_logits:  # each row's last token: cu_seqlens_q[1:] - 1 (pad rows: any)
            out = self.logits[: b.rows]

            def forward() -> None:
                last = meta.cu_seqlens_q[1:].to(torch.int64) - 1
                out.copy_(self.model(ids, pos, meta, self.kv_cache, last, self.num_layers))

            return forward
        out = self.logits[: b.tokens]

        def forward() -> None:
            out.copy_(self.model(ids, pos, meta, self.kv_cache, None, self.num_layers))

        return forward

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph | EagerReplay:
        if self.is_emulated:  # nothing to capture: replays run fn
            return EagerReplay(fn)
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream(device=self.device)
        return capture_graph(fn, self.device, self._pool, self._warmup_stream, self.num_warmup)

    def _capture_all(self, graph_backend: str | None, progress: bool) -> None:
        t0 = time.perf_counter()
        order = sorted(self.buckets, key=lambda b: (b.tokens, b.rows, b.max_q), reverse=True)
        desc = f"capturing {self.name} CUDA graphs" + (" (emulated)" if self.is_emulated else "")
        with (
            captured_backend(self.model, graph_backend, self.is_emulated),
            torch.inference_mode(),
            CaptureMemory(self.device) as memory,
        ):
            for b in tqdm(order, desc=desc, disable=not progress, unit="graph"):
                self._load_padding(b)
                self._graphs[b] = self._capture(self._forward_fn(b))
        self.graph_memory_bytes = memory.bytes
        self.capture_s = time.perf_counter() - t0
        logger.info(
            "%s: captured %d graphs (largest %d rows / %d tokens, max_q %d) in %.1f s, "
            "graph memory %.1f MiB%s",
            self.name, self.num_graphs, self.max_rows, self.max_tokens, self.max_captured_q,
            self.capture_s, self.graph_memory_bytes / 2**20, " (emulated)" if self.is_emulated else "",
        )  # fmt: skip

    def _load_padding(self, b: GraphBucket) -> None:
        """Fill the bucket's buffers with an all-padding batch (warm-up and capture inputs)."""
        self._upload(_empty_batch(self.max_blocks), self.layouts[b])

    # ---- replay ---------------------------------------------------------------------------------
    def _upload(self, x: HostInputs, lay: InputLayout) -> None:
        """``x`` padded to ``lay`` into a staging buffer, then one copy into the static buffer."""
        i = self._staging.acquire()
        x.write(lay, self._staging.arrays[i])
        n = lay.nbytes
        self.input_buffer[:n].copy_(self._staging.host[i][:n], non_blocking=True)
        self._staging.copied(i)

    def _replay(self, b: GraphBucket, num_tokens: int) -> torch.Tensor:  # [num_tokens, vocab] view
        self._graphs[b].replay()
        self.num_replays += 1
        return self.logits[:num_tokens]

    @torch.inference_mode()
    def run_host(self, x: HostInputs, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``x``'s tokens (or of its ``logits_indices``): a graph replay when a bucket fits,
        else an eager forward (counted). ``device_ids`` (int64 on the device), when given, hold the
        ids of the tokens at ``x.scatter_index`` (``device_ids[x.gather_index]`` with a gather
        index): a device-side proposer's tokens, never read on the host.

        Device work per replay: one host-to-device copy, the replay, plus one ``index_copy_`` (and
        one ``index_select`` with a gather index) for ``device_ids``, and one ``index_select`` for
        ``logits_indices`` when those are given. The
        result is a view of the static logits buffer when no indices are given: valid until this
        runner's next replay."""
        if (device_ids is None) != (x.scatter_index is None):
            raise ValueError("device ids and HostInputs.scatter_index must be given together")
        if self.is_last_token_logits and (
            x.logits_indices is None or not np.array_equal(x.logits_indices, x.cu_seqlens_q[1:] - 1)
        ):
            raise ValueError(f"{self.name} graphs compute rows' last tokens: pass those as logits_indices")
        t = x.num_tokens
        b, reason, detail = self.find_bucket(x.num_rows, t, x.max_q, x.width, x.max_k)
        if b is None:
            ids, pos, meta, logits_indices = x.to_device(self.device, device_ids)
            return self.run_eager(ids, pos, meta, reason, detail, logits_indices)
        lay = self.layouts[b].with_tails(*x.num_tails)
        self._upload(x, lay)
        if self.is_last_token_logits:
            return self._replay(b, x.num_rows)
        if device_ids is None and x.logits_indices is None:
            return self._replay(b, t)
        logits_indices, scatter, gather = lay.split_tails(self.input_buffer)
        if device_ids is not None:
            x.scatter_ids(self._ids_views[b], scatter, gather, device_ids)
        logits = self._replay(b, t)
        return logits if x.logits_indices is None else logits.index_select(0, logits_indices)

    def _load_device(
        self, b: GraphBucket, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Copy device inputs already padded to ``b``'s shapes into its views (six copies)."""
        want = (b.tokens, b.tokens, b.rows + 1, b.rows, (b.rows, self.max_blocks), b.tokens)
        got = (ids.shape[0], pos.shape[0], meta.cu_seqlens_q.shape[0], meta.seq_lens_k.shape[0],
               tuple(meta.block_tables.shape), meta.slot_mapping.shape[0])  # fmt: skip
        if got != want:
            raise ValueError(f"padded inputs have shapes {got}, bucket {b} needs {want}")
        s_ids, s_pos, s_meta, _ = self._views(self.layouts[b], b.max_q)
        for dst, src in [
            (s_ids, ids), (s_pos, pos), (s_meta.slot_mapping, meta.slot_mapping),
            (s_meta.cu_seqlens_q, meta.cu_seqlens_q), (s_meta.seq_lens_k, meta.seq_lens_k),
            (s_meta.block_tables, meta.block_tables),
        ]:  # fmt: skip
            dst.copy_(src, non_blocking=True)

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, vocab] float32
        """Logits of every token for inputs already on the device: a graph replay when a bucket fits
        (padded on the device: a dozen device ops more than :meth:`run_host`), else an eager forward
        (counted). The result is a view of the static logits buffer (see :meth:`run_host`)."""
        if self.is_last_token_logits:
            raise ValueError(f"{self.name} graphs compute last-token logits: use run_host")
        t = meta.num_tokens
        if input_ids.shape[0] != t or positions.shape[0] != t:
            raise ValueError(
                f"input_ids/positions have {input_ids.shape[0]}/{positions.shape[0]} tokens, meta {t}"
            )
        width = meta.block_tables.shape[1]
        b, reason, detail = self.find_bucket(meta.num_rows, t, meta.max_q, width, meta.max_k)
        if b is None:
            return self.run_eager(input_ids, positions, meta, reason, detail)
        padded = pad_inputs(
            input_ids, positions, meta, b.rows, b.tokens, self.max_blocks, b.max_q, self.max_k
        )
        self._load_device(b, *padded)
        return self._replay(b, t)

    def run_eager(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        reason: str,
        detail: str,
        logits_indices: torch.Tensor | None = None,  # [L] int64
    ) -> torch.Tensor:  # [T or L, vocab] float32
        """The eager forward for a shape no graph covers; logged once per reason, always counted."""
        self.note_fallback(reason, detail)
        return self.model(input_ids, positions, meta, self.kv_cache, logits_indices, self.num_layers)

    def note_fallback(self, reason: str, detail: str) -> None:
        """Count (and log, the first time per reason) a forward that ran eagerly outside the buckets;
        for callers that run their own eager path (the engine's padded prefill)."""
        if not self.fallback_reasons[reason]:
            logger.warning("%s graphs: running eagerly (%s): %s", self.name, reason, detail)
        else:
            logger.debug("%s graphs: running eagerly (%s): %s", self.name, reason, detail)
        self.fallback_reasons[reason] += 1
        self.num_eager_fallbacks += 1

    def bucket_for(self, x: HostInputs) -> tuple[GraphBucket | None, str, str]:
        """:meth:`find_bucket` for a host batch."""
        return self.find_bucket(x.num_rows, x.num_tokens, x.max_q, x.width, x.max_k)


def _empty_batch(width: int) -> HostInputs:
    """A batch of no rows and no tokens (everything in its layout is padding)."""
    z64 = np.zeros(0, dtype=np.int64)
    return HostInputs(z64, z64, z64, np.zeros(1, np.int64), z64, np.zeros((0, width), np.int32), 0, 0)
