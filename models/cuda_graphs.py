"""CUDA graphs of the model forward over (rows, tokens) buckets, with padding and eager fallback.

A :class:`GraphRunner` captures ``model.forward`` once per :class:`GraphBucket` into a
``torch.cuda.CUDAGraph`` that reads static input buffers (one set of max-size buffers, sliced per
bucket) and allocates from one shared memory pool. The logits are copied inside the graph into a
static ``[max_tokens, vocab]`` buffer, so nothing of a graph's own pool memory stays alive after its
capture and the graphs may be replayed in any order. ``run`` picks the smallest bucket that fits the
real batch, pads the inputs into the buffers, replays and returns the real tokens' logits. A shape
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

import torch
from tqdm.auto import tqdm

from specsched.kernels.metadata import AttentionMetadata
from specsched.models.graph_buckets import PAD_SLOT, GraphBucket, as_bucket, pad_inputs
from specsched.models.llama import KVCache, LlamaForCausalLM

logger = logging.getLogger(__name__)


class _EagerReplay:
    """CPU stand-in for a CUDAGraph (``emulate=True``, tests only): replay re-runs the captured
    function on the static buffers, which exercises the bucketing and padding but saves nothing."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


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
    ) -> None:
        self.model, self.kv_cache, self.name = model, kv_cache, name
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
        rows, tokens = self.max_rows, self.max_tokens
        with torch.inference_mode():
            z = dict(device=self.device)
            self.input_ids = torch.zeros(tokens, dtype=torch.int64, **z)  # [T]
            self.positions = torch.zeros(tokens, dtype=torch.int64, **z)  # [T]
            self.slot_mapping = torch.full((tokens,), PAD_SLOT, dtype=torch.int64, **z)  # [T]
            self.cu_seqlens_q = torch.zeros(rows + 1, dtype=torch.int32, **z)  # [R+1]
            self.seq_lens_k = torch.zeros(rows, dtype=torch.int32, **z)  # [R]
            self.block_tables = torch.zeros(rows, max_blocks_per_row, dtype=torch.int32, **z)  # [R, W]
            self.logits = torch.zeros(tokens, model.cfg.vocab_size, dtype=torch.float32, **z)  # [T, V]
        self._pool = None if emulate else torch.cuda.graph_pool_handle()
        self._warmup_stream: torch.cuda.Stream | None = None
        self._graphs: dict[GraphBucket, torch.cuda.CUDAGraph | _EagerReplay] = {}
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
        return {
            "name": self.name,
            "num_graphs": self.num_graphs,
            "graph_memory_mib": round(self.graph_memory_bytes / 2**20, 1),
            "capture_s": round(self.capture_s, 2),
            "num_replays": self.num_replays,
            "num_eager_fallbacks": self.num_eager_fallbacks,
            "fallback_reasons": dict(self.fallback_reasons),
        }

    # ---- capture --------------------------------------------------------------------------------
    def _meta(self, b: GraphBucket) -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[: b.rows + 1],
            seq_lens_k=self.seq_lens_k[: b.rows],
            block_tables=self.block_tables[: b.rows],
            slot_mapping=self.slot_mapping[: b.tokens],
            max_q=b.max_q,
            max_k=self.max_k,
        )

    def _forward_fn(self, b: GraphBucket) -> Callable[[], None]:
        ids, pos, out = self.input_ids[: b.tokens], self.positions[: b.tokens], self.logits[: b.tokens]
        meta = self._meta(b)

        def forward() -> None:
            out.copy_(self.model(ids, pos, meta, self.kv_cache, None, self.num_layers))

        return forward

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph | _EagerReplay:
        if self.is_emulated:  # nothing to capture: replays run fn
            return _EagerReplay(fn)
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream(device=self.device)
        stream = self._warmup_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks, outside the capture
            for _ in range(self.num_warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        return graph

    def _capture_all(self, graph_backend: str | None, progress: bool) -> None:
        prev = self.model.attn_backend
        switch = not self.is_emulated and graph_backend is not None and graph_backend != prev
        if switch:
            self.model.set_attn_backend(graph_backend)
        is_cuda = self.device.type == "cuda"
        t0 = time.perf_counter()
        try:
            if is_cuda:  # memory before/after, without the allocator's cached blocks
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
                free0 = torch.cuda.mem_get_info(self.device)[0]
            order = sorted(self.buckets, key=lambda b: (b.tokens, b.rows, b.max_q), reverse=True)
            desc = f"capturing {self.name} CUDA graphs" + (" (emulated)" if self.is_emulated else "")
            with torch.inference_mode():
                for b in tqdm(order, desc=desc, disable=not progress, unit="graph"):
                    self._load_padding(b)
                    self._graphs[b] = self._capture(self._forward_fn(b))
            if is_cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
                self.graph_memory_bytes = max(0, free0 - torch.cuda.mem_get_info(self.device)[0])
        finally:
            if switch:
                self.model.set_attn_backend(prev)
        self.capture_s = time.perf_counter() - t0
        logger.info(
            "%s: captured %d graphs (largest %d rows / %d tokens, max_q %d) in %.1f s, "
            "graph memory %.1f MiB%s",
            self.name, self.num_graphs, self.max_rows, self.max_tokens, self.max_captured_q,
            self.capture_s, self.graph_memory_bytes / 2**20, " (emulated)" if self.is_emulated else "",
        )  # fmt: skip

    def _load_padding(self, b: GraphBucket) -> None:
        """Fill the bucket's buffers with an all-padding batch (warm-up and capture inputs)."""
        empty = AttentionMetadata(
            cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=self.device),
            seq_lens_k=torch.zeros(0, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(0, self.max_blocks, dtype=torch.int32, device=self.device),
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=self.device),
            max_q=0,
            max_k=0,
        )
        ids = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._load(b, *pad_inputs(ids, ids, empty, b.rows, b.tokens, self.max_blocks, b.max_q, self.max_k))

    # ---- replay ---------------------------------------------------------------------------------
    def _load(self, b: GraphBucket, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> None:
        want = (b.tokens, b.tokens, b.rows + 1, b.rows, (b.rows, self.max_blocks), b.tokens)
        got = (ids.shape[0], pos.shape[0], meta.cu_seqlens_q.shape[0], meta.seq_lens_k.shape[0],
               tuple(meta.block_tables.shape), meta.slot_mapping.shape[0])  # fmt: skip
        if got != want:
            raise ValueError(f"padded inputs have shapes {got}, bucket {b} needs {want}")
        self.input_ids[: b.tokens].copy_(ids, non_blocking=True)
        self.positions[: b.tokens].copy_(pos, non_blocking=True)
        self.slot_mapping[: b.tokens].copy_(meta.slot_mapping, non_blocking=True)
        self.cu_seqlens_q[: b.rows + 1].copy_(meta.cu_seqlens_q, non_blocking=True)
        self.seq_lens_k[: b.rows].copy_(meta.seq_lens_k, non_blocking=True)
        self.block_tables[: b.rows].copy_(meta.block_tables, non_blocking=True)

    @torch.inference_mode()
    def replay(
        self, b: GraphBucket, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, num_tokens: int
    ) -> torch.Tensor:  # [num_tokens, vocab] float32, a fresh tensor
        """Replay bucket ``b`` on inputs already padded to its shapes; the first ``num_tokens`` are real."""
        self._load(b, ids, pos, meta)
        self._graphs[b].replay()
        self.num_replays += 1
        return self.logits[:num_tokens].clone()

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, vocab] float32
        """Logits of every token: a graph replay when a bucket fits, else an eager forward (counted)."""
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
        return self.replay(b, *padded, t)

    def run_eager(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        reason: str,
        detail: str,
    ) -> torch.Tensor:  # [T, vocab] float32
        """The eager forward for a shape no graph covers; logged once per reason, always counted."""
        if not self.fallback_reasons[reason]:
            logger.warning("%s graphs: running eagerly (%s): %s", self.name, reason, detail)
        else:
            logger.debug("%s graphs: running eagerly (%s): %s", self.name, reason, detail)
        self.fallback_reasons[reason] += 1
        self.num_eager_fallbacks += 1
        return self.model(input_ids, positions, meta, self.kv_cache, None, self.num_layers)
