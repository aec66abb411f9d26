"""Piecewise CUDA graphs: every op of the forward but the attention on graphs, per token count.

The eager MQA scorer runs varlen attention over any mix of per-request k, which no fixed graph
shape covers without padding rows; eagerly, a llama2-7b forward launches ~12 kernels per layer from
Python and is launch-bound (3.6x the weight-streaming floor at batch 1, k 3 on an H100, against
1.4x on a graph; docs/benchmarks.md). Everything outside the attention is per token (norms, GEMMs,
RoPE, the K/V store, SiLU-mul), so it depends on the token count alone: a :class:`PiecewiseRunner`
captures, for each token bucket ``T``, ``L + 1`` graphs split at the ``L`` attentions (the scheme
of vLLM V1's piecewise CUDA graphs):

- piece 0: RoPE's cos/sin, the embeddings, layer 0 up to its attention
  (:meth:`~specsched.models.llama.LlamaDecoderLayer.pre_attention`);
- piece l (1 <= l < L): layer l-1 after its attention
  (:meth:`~specsched.models.llama.LlamaDecoderLayer.post_attention`), layer l up to its own;
- piece L: layer L-1 after its attention, the final norm and the LM head (logits copied into a static
  buffer).

Between pieces the runner launches the attention of the real rows eagerly, with the batch's own
metadata (any rows, any q_len), reading the rotated q from a static buffer and writing its output
into another: a forward is ``L + 1`` graph replays and ``L`` attention launches (two with split-KV).
The tensors that cross a piece boundary live in static buffers shared by every bucket (graphs and
attention never run concurrently): token inputs, cos/sin, q, the attention output, and the
residual stream (a piece reads it in its first norm and writes it in its last, from new tensors). Tokens
``t..T-1`` of a bucket are padding: their K/V go to the pad slot (block 0, never a request's) and
their rows are not read by any real row's attention; their outputs are discarded.

``emulate=True`` (tests, CPU) replays each piece by running it eagerly on the same buffers: the
split, the buffers and the padding are exercised, nothing is captured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch
from tqdm.auto import tqdm

from specsched.kernels.metadata import AttentionMetadata
from specsched.models.graph_buckets import PAD_SLOT
from specsched.models.graph_capture import CaptureMemory, EagerReplay, graph_stats
from specsched.models.llama import KVCache, LlamaForCausalLM

logger = logging.getLogger(__name__)


class PiecewiseRunner:
    """Piecewise graphs of ``model.forward`` over ``kv_cache``, token counts up to ``max(token_buckets)``."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        token_buckets: Iterable[int],
        *,
        name: str = "piecewise",
        emulate: bool = False,
        progress: bool = True,
        num_warmup: int = 1,
    ) -> None:
        self.model, self.kv_cache, self.name = model, kv_cache, name
        self.device = model.lm_head.weight.device
        self.is_emulated = emulate
        if self.device.type != "cuda" and not emulate:
            raise ValueError(f"piecewise CUDA graphs need the model on CUDA, it is on {self.device}")
        if model.deterministic or model.fused_linear:
            raise ValueError("piecewise graphs run the default path: not with deterministic or fused_linear")
        self.buckets = sorted(set(token_buckets))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"piecewise graphs need token buckets >= 1, got {self.buckets}")
        cfg = model.cfg
        self.num_layers = cfg.num_layers
        if len(kv_cache) < self.num_layers:
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {self.num_layers}")
        self.num_warmup = num_warmup
        self.num_replays = 0
        self.num_eager_fallbacks = 0
        self.capture_s = 0.0
        self.graph_memory_bytes = 0
        t, dt, dev = self.max_tokens, model.lm_head.weight.dtype, self.device
        heads, d = cfg.num_heads, cfg.head_dim
        with torch.inference_mode():
            self.ids = torch.zeros(t, dtype=torch.int64, device=dev)  # [T]
            self.positions = torch.zeros(t, dtype=torch.int64, device=dev)  # [T]
            self.slots = torch.full((t,), PAD_SLOT, dtype=torch.int64, device=dev)  # [T]
            self.cos = torch.zeros(t, d // 2, dtype=torch.float32, device=dev)  # [T, D/2]
            self.sin = torch.zeros(t, d // 2, dtype=torch.float32, device=dev)  # [T, D/2]
            self.q = torch.zeros(t, heads, d, dtype=dt, device=dev)  # [T, heads, D]: attention input
            self.o = torch.zeros(t, heads, d, dtype=dt, device=dev)  # [T, heads, D]: attention output
            self.residual = torch.zeros(t, cfg.hidden_size, dtype=dt, device=dev)  # [T, hidden]
            self.logits = torch.zeros(t, cfg.vocab_size, dtype=torch.float32, device=dev)  # [T, V]
        self._pool = None if emulate else torch.cuda.graph_pool_handle()
        self._graphs: dict[int, list[torch.cuda.CUDAGraph | EagerReplay]] = {}
        self._capture_all(progress)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def num_graphs(self) -> int:
        return sum(map(len, self._graphs.values()))

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket holding ``num_tokens`` tokens (None: above the largest)."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def stats(self) -> dict:
        return graph_stats(self)

    # ---- the pieces ---------------------------------------------------------------------------
    def _pieces(self, t: int) -> list[Callable[[], None]]:
        """The ``L + 1`` pieces of a ``t``-token forward, each reading and writing the static buffers."""
        model, layers, kv = self.model, self.model.model.layers, self.kv_cache
        ids, slots, cos, sin, q = self.ids[:t], self.slots[:t], self.cos[:t], self.sin[:t], self.q[:t]
        o, res = self.o[:t], self.residual[:t]  # res: the residual stream after a layer's input norm

        def first() -> None:
            freqs = self.positions[:t].float()[:, None] * model.inv_freq[None, :]  # [t, D/2]
            torch.cos(freqs, out=cos)
            torch.sin(freqs, out=sin)
            x = torch.index_select(model.model.embed_tokens.weight, 0, ids, out=res)
            layers[0].pre_attention(x, None, cos, sin, kv[0], slots, q_out=q)

        def middle(layer: int) -> Callable[[], None]:
            def piece() -> None:
                x, residual = layers[layer - 1].post_attention(o, res)  # reads res, makes a new residual
                kv_l = kv[layer]
                layers[layer].pre_attention(x, residual, cos, sin, kv_l, slots, q_out=q, residual_out=res)

            return piece

        def last() -> None:
            n = self.num_layers
            x, residual = layers[n - 1].post_attention(o, res)
            self.logits[:t].copy_(model.lm_head(model.model.norm.add_and_norm(x, residual)[0]).float())

        return [first, *(middle(i) for i in range(1, self.num_layers)), last]

    # ---- capture ------------------------------------------------------------------------------
    def _capture(
        self, fn: Callable[[], None], stream: torch.cuda.Stream | None
    ) -> torch.cuda.CUDAGraph | EagerReplay:
        if self.is_emulated:
            return EagerReplay(fn)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            fn()
        return graph

    def _capture_all(self, progress: bool) -> None:
        is_cuda = self.device.type == "cuda"
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(device=self.device) if is_cuda and not self.is_emulated else None
        desc = f"capturing {self.name} piecewise graphs" + (" (emulated)" if self.is_emulated else "")
        with torch.inference_mode(), CaptureMemory(self.device) as memory:
            for t in tqdm(sorted(self.buckets, reverse=True), desc=desc, disable=not progress, unit="bucket"):
                pieces = self._pieces(t)
                if stream is not None:  # warm-up: Triton compiles, cuBLAS picks, outside any capture
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(stream):
                        for _ in range(self.num_warmup):
                            for piece in pieces:
                                piece()
                    torch.cuda.current_stream(self.device).wait_stream(stream)
                self._graphs[t] = [self._capture(piece, stream) for piece in pieces]
        self.graph_memory_bytes = memory.bytes
        self.capture_s = time.perf_counter() - t0
        logger.info(
            "%s: captured %d piecewise graphs (%d token buckets up to %d, %d layers) in %.1f s, "
            "graph memory %.1f MiB%s",
            self.name, self.num_graphs, len(self.buckets), self.max_tokens, self.num_layers, self.capture_s,
            self.graph_memory_bytes / 2**20, " (emulated)" if self.is_emulated else "",
        )  # fmt: skip

    # ---- run ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [t] int64
        positions: torch.Tensor,  # [t] int64
        meta: AttentionMetadata,  # the batch's own rows (tokens past its rows are padding)
    ) -> torch.Tensor:  # [t, vocab] float32, a view of the static logits (valid until the next forward)
        """Logits of every token: the pieces of the smallest bucket holding ``t`` tokens, with the
        attention of ``meta``'s rows launched between them; an eager forward above the largest bucket
        (counted)."""
        t = input_ids.shape[0]
        if positions.shape[0] != t or meta.slot_mapping.shape[0] != t:
            raise ValueError(
                f"input_ids, positions and meta.slot_mapping must have one length, got {t}, "
                f"{positions.shape[0]}, {meta.slot_mapping.shape[0]}"
            )
        b = self.bucket(t)
        if b is None or t == 0:
            self.num_eager_fallbacks += 1
            return self.model(input_ids, positions, meta, self.kv_cache)
        self.ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.slots[:t].copy_(meta.slot_mapping, non_blocking=True)
        if b > t:
            self.slots[t:b].fill_(PAD_SLOT)
        graphs, attn, kv = self._graphs[b], self.model.attn, self.kv_cache
        scale = self.model.model.layers[0].self_attn.scale
        q, o = self.q[:t], self.o[:t]
        for layer in range(self.num_layers):
            graphs[layer].replay()
            attn(q, kv[layer][0], kv[layer][1], meta, scale, out=o)
        graphs[-1].replay()
        self.num_replays += 1
        return self.logits[:t]
