"""Graph-backed scorers and draft steps: batch expansion on decode graphs, MQA on (rows, tokens) graphs.

- :class:`GraphBatchExpansionScorer` (``batch_expansion``): sum(k_i + 1) single-query rows, served by
  the decode buckets (rows 1, 2, 4, 8, 16, 24, 32, 48, 64, ...), the same graphs as plain decode.
- :class:`MQAGraphScorer` (``mqa_graph``): one varlen row per request, served by MQA buckets that
  capture q_len <= max_k + 1 as the upper bound (a batch with every k_i = 0 takes a decode bucket).
Both share one :class:`~specsched.models.cuda_graphs.GraphRunner` over the target (one memory pool,
one set of static buffers); inputs are built on the host by ``metadata_gpu`` and travel padded in one
copy into the runner's static buffer. A shape outside the buckets runs eagerly, logged and counted by
the runner.

:func:`build_graph_scorers` builds them when graphs are usable (the registry's ``build_scorers``
decides; without CUDA, or with graphs off, it builds the eager scorers instead).
:func:`attach_draft_graphs` gives a draft-model proposer graph-replayed single-token steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from specsched.engine.request import Request
from specsched.kernels.metadata import AttentionMetadata
from specsched.models.cuda_graphs import GraphRunner
from specsched.models.draft_loop import DraftLoopGraphs
from specsched.models.graph_buckets import (
    HostInputs,
    decode_buckets,
    mqa_buckets,
    prefill_buckets,
    size_ladder,
)
from specsched.models.llama import KVCache, LlamaForCausalLM
from specsched.models.piecewise_graphs import PiecewiseRunner
from specsched.proposers.base import Proposals, Proposer
from specsched.scorers.base import Scorer
from specsched.scorers.metadata_gpu import pack_scoring_batch, scoring_host_inputs
from specsched.scorers.mqa import MQAScorer

logger = logging.getLogger(__name__)


@dataclass
class GraphConfig:
    """CUDA graphs of the target (decode + MQA buckets) and of the draft (decode buckets)."""

    enabled: bool = True
    max_batch: int = 64  # requests per step (scheduler.max_num_seqs): MQA and draft rows
    max_k: int = 8  # spec.max_k: MQA buckets capture q_len <= max_k + 1
    max_model_len: int = 4096  # captured block-table width = ceil(max_model_len / block_size)
    max_expanded_rows: int | None = None  # batch-expansion rows; None = max_batch * (max_k + 1)
    backend: str = "triton"  # attention backend captured into the graphs
    emulate: bool = False  # tests only: "replay" re-runs the forward eagerly (CPU), nothing is captured
    progress: bool = True  # tqdm bar while capturing
    num_warmup: int = 1  # eager runs per bucket before its capture
    # prefill chunks of up to prefill_rows prompts / prefill_tokens tokens on graphs (0 tokens: eager)
    prefill_rows: int = 16
    prefill_tokens: int = 2048
    # the eager MQA scorer (``mqa``) on piecewise graphs: every op but the attention replayed per
    # token count (up to max_batch * (max_k + 1) tokens), the attention eager over the batch's own
    # rows (models/piecewise_graphs.py); off: every kernel launched from Python
    piecewise: bool = False
    # a separate draft model's MQA buckets capture q_len <= this: its catch-up after a plain step is
    # 3 tokens (the last draft, the bonus, the plain step's token), after a run of S plain steps 2 + S,
    # for a request that drafted nothing last step as much; above it the catch-up runs eagerly
    # (2026-12-06 H100, 7B pair at batch 64: 4-11 ms a step against ~1 ms on graphs)
    draft_max_q: int = 6
    # a greedy draft's single-token steps in one replay per propose (models/draft_loop.py; draft.loop_graphs)
    draft_loop: bool = False

    def __post_init__(self) -> None:
        if self.prefill_rows < 1 or self.prefill_tokens < 0:
            raise ValueError(
                f"graphs.prefill_rows must be >= 1 and prefill_tokens >= 0, got {self.prefill_rows}, "
                f"{self.prefill_tokens}"
            )
        for name in ("max_batch", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"graphs.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_k < 0:
            raise ValueError(f"graphs.max_k must be >= 0, got {self.max_k}")
        if self.max_expanded_rows is not None and self.max_expanded_rows < 1:
            raise ValueError(f"graphs.max_expanded_rows must be >= 1, got {self.max_expanded_rows}")
        if self.num_warmup < 0:
            raise ValueError(f"graphs.num_warmup must be >= 0, got {self.num_warmup}")
        if self.draft_max_q < 2:
            raise ValueError(f"graphs.draft_max_q must be >= 2, got {self.draft_max_q}")

    @property
    def expanded_rows(self) -> int:
        return self.max_expanded_rows or self.max_batch * (self.max_k + 1)

    def max_blocks(self, block_size: int) -> int:
        return -(-self.max_model_len // block_size)

    @classmethod
    def for_engine(cls, cfg, max_model_len: int, **overrides) -> GraphConfig:
        """From an ``EngineConfig``: max_batch = scheduler.max_num_seqs, max_k = spec.max_k, prefill
        graphs up to ``model.prefill_graph_tokens`` (within the chunk budget) and
        ``model.prefill_graph_rows`` prompts (within max_num_seqs), draft catch-ups up to a run of
        ``scheduler.decode_steps`` plain steps."""
        sched = cfg.scheduler
        prefill = min(cfg.model.prefill_graph_tokens, sched.max_num_batched_tokens)
        rows = min(cfg.model.prefill_graph_rows, sched.max_num_seqs)
        kw = dict(max_batch=sched.max_num_seqs, max_k=cfg.spec.max_k, max_model_len=max_model_len,
                  prefill_rows=rows, prefill_tokens=prefill, piecewise=cfg.model.piecewise_graphs,
                  draft_max_q=max(cls.draft_max_q, 2 + sched.decode_steps),
                  draft_loop=cfg.spec.draft.loop_graphs)  # fmt: skip
        return cls(**{**kw, **overrides})

    def uses_graphs(self, device: torch.device) -> bool:
        return self.enabled and (device.type == "cuda" or self.emulate)


class GraphScorer(Scorer):
    """Scores through a runner's graphs; the flat logits layout of :class:`Scorer`."""

    is_expanded: bool = False

    def __init__(self, runner: GraphRunner, block_size: int) -> None:
        self.runner, self.block_size = runner, block_size
        self.device = runner.device

    @torch.inference_mode()
    def score(self, batch: list[Request], proposals: Proposals) -> torch.Tensor:  # [sum(k_i+1), vocab]
        """The logits, a view of the runner's static buffer (valid until its next replay)."""
        sb = pack_scoring_batch(batch, proposals, self.block_size)
        drafts = proposals.draft_tokens
        x = scoring_host_inputs(sb, drafts, is_expanded=self.is_expanded)
        return self.runner.run_host(x, drafts if x.scatter_index is not None else None)

    def decode_forward(
        self, x: HostInputs, device_ids: torch.Tensor | None = None
    ) -> torch.Tensor:  # [>= x.num_rows, vocab]
        """A plain decode step on the runner's decode buckets (the rows a k = 0 ``score`` runs)."""
        return self.runner.run_host(x, device_ids)

    @property
    def graph_buckets(self) -> list[int]:
        """Padded sizes for the cost model: rows (batch expansion) or tokens (MQA) of the buckets."""
        runner = self.runner
        if self.is_expanded:
            return sorted({b.rows for b in runner.buckets if b.is_decode})
        return sorted({b.tokens for b in runner.buckets})


class GraphBatchExpansionScorer(GraphScorer):
    name = "batch_expansion"
    is_expanded = True


class MQAGraphScorer(GraphScorer):
    name = "mqa_graph"
    is_expanded = False


def build_target_runner(
    names: list[str], model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, cfg: GraphConfig
) -> GraphRunner:
    """One runner for every graph scorer named: decode buckets (batch expansion rows, or the
    batch size when only ``mqa_graph`` is named) plus MQA buckets when ``mqa_graph`` is named."""
    rows = cfg.expanded_rows if "batch_expansion" in names else cfg.max_batch
    buckets = decode_buckets(rows)
    if "mqa_graph" in names and cfg.max_k >= 1:
        buckets += mqa_buckets(cfg.max_batch, cfg.max_k + 1)
    return GraphRunner(
        model, kv_cache, buckets, cfg.max_blocks(block_size), name="target", graph_backend=cfg.backend,
        emulate=cfg.emulate, progress=cfg.progress, num_warmup=cfg.num_warmup,
    )  # fmt: skip


def build_prefill_runner(
    model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, cfg: GraphConfig
) -> GraphRunner | None:
    """Graphs of prefill chunks (:func:`~specsched.models.graph_buckets.prefill_buckets`; each row's
    last-token logits), or None when graphs are off here or ``cfg.prefill_tokens`` is 0. An eager
    prefill forward is launch-bound: ~16 ms for SmolLM2's 30 layers on the H200, against ~2 ms of
    decode step, and a serving loop at 16-64 clients runs one every step or two."""
    if not cfg.uses_graphs(model.lm_head.weight.device) or cfg.prefill_tokens == 0:
        return None
    return GraphRunner(
        model, kv_cache, prefill_buckets(cfg.prefill_rows, cfg.prefill_tokens), cfg.max_blocks(block_size),
        name="prefill", graph_backend=cfg.backend, emulate=cfg.emulate, progress=cfg.progress,
        num_warmup=cfg.num_warmup, last_token_logits=True,
    )  # fmt: skip


def build_graph_scorers(
    names: list[str], model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, cfg: GraphConfig
) -> dict[str, Scorer]:
    """The named scorers with ``batch_expansion``/``mqa_graph`` on CUDA graphs (``cfg`` allows them:
    :func:`specsched.scorers.registry.build_scorers` checks); ``mqa`` eager, or on piecewise graphs
    with ``cfg.piecewise``."""
    graph_names = [n for n in names if n != "mqa"]
    runner = build_target_runner(graph_names, model, kv_cache, block_size, cfg) if graph_names else None
    out: dict[str, Scorer] = {}
    for n in names:
        if n == "batch_expansion":
            out[n] = GraphBatchExpansionScorer(runner, block_size)
        elif n == "mqa_graph":
            out[n] = MQAGraphScorer(runner, block_size)
        else:
            out[n] = MQAScorer(model, kv_cache, block_size, build_piecewise_runner(model, kv_cache, cfg))
    return out


def build_piecewise_runner(
    model: LlamaForCausalLM, kv_cache: KVCache, cfg: GraphConfig
) -> PiecewiseRunner | None:
    """The eager MQA scorer's piecewise graphs (``cfg.piecewise``), token buckets of the size ladder up
    to ``max_batch * (max_k + 1)``; None when off."""
    if not cfg.piecewise:
        return None
    return PiecewiseRunner(
        model, kv_cache, size_ladder(cfg.max_batch * (cfg.max_k + 1)), name="mqa piecewise",
        emulate=cfg.emulate, progress=cfg.progress, num_warmup=cfg.num_warmup,
    )  # fmt: skip


def graph_buckets_of(scorers: dict[str, Scorer]) -> dict[str, list[int]]:
    """``CostModels(graph_buckets=...)`` for the graph scorers among ``scorers``."""
    return {n: s.graph_buckets for n, s in scorers.items() if isinstance(s, GraphScorer)}


def graph_runners_of(scorers: dict[str, Scorer]) -> list[GraphRunner]:
    """The distinct runners behind the graph scorers (for stats: replays, fallbacks, memory)."""
    seen: dict[int, GraphRunner] = {}
    for s in scorers.values():
        if isinstance(s, GraphScorer):
            seen.setdefault(id(s.runner), s.runner)
    return list(seen.values())


class GraphForward:
    """A callable with ``LlamaForCausalLM.forward``'s signature over a runner, for a draft model:
    calls whose rows all fit a captured ``max_q`` (the single-token proposal steps) replay graphs;
    others (the multi-token catch-up after verification) run the model eagerly by design and are
    counted in ``num_eager_calls`` (not as fallbacks)."""

    def __init__(self, runner: GraphRunner) -> None:
        self.runner = runner
        self.num_eager_calls = 0

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: torch.Tensor | None = None,  # [L] int64
        num_layers: int | None = None,
    ) -> torch.Tensor:  # [L, vocab] float32
        r = self.runner
        if kv_cache is not r.kv_cache or (num_layers or r.model.cfg.num_layers) != r.num_layers:
            raise ValueError(
                f"GraphForward({r.name}) was captured over another KV cache or layer count "
                f"(runner: {r.num_layers} layers, call: {num_layers})"
            )
        if meta.max_q > r.max_captured_q:
            self.num_eager_calls += 1
            return r.model(input_ids, positions, meta, kv_cache, logits_indices, num_layers)
        logits = r.run(input_ids, positions, meta)
        return logits if logits_indices is None else logits.index_select(0, logits_indices)

    def run_host(self, x: HostInputs, device_ids: torch.Tensor | None = None) -> torch.Tensor:  # [L or T, V]
        """The same from host inputs (``x.logits_indices``: the rows wanted; ``device_ids``: see
        :meth:`GraphRunner.run_host`): one upload per replay. Rows of one token each need no index
        select (every token's logits are wanted)."""
        r = self.runner
        if x.max_q > r.max_captured_q:
            self.num_eager_calls += 1
            ids, pos, meta, logits_indices = x.to_device(r.device, device_ids)
            return r.model(ids, pos, meta, r.kv_cache, logits_indices, r.num_layers)
        if x.logits_indices is not None and x.max_q <= 1 and len(x.logits_indices) == x.num_tokens:
            x = replace(x, logits_indices=None)  # one-token rows: every token's logits are wanted
        return r.run_host(x, device_ids)


def attach_draft_graphs(proposer: Proposer, cfg: GraphConfig, block_size: int) -> GraphForward | None:
    """Capture graphs of a draft-model proposer's model (its first ``num_layers`` layers for a
    self-draft) over its own KV cache, and hand them to it as ``proposer.graph_forward``: decode
    buckets for the single-token steps, plus MQA buckets for the catch-up: q_len <= 2 (the last
    draft + the bonus token after a fully accepted step) for a self-draft on the target's cache,
    which never lags more, else q_len <= ``cfg.draft_max_q`` (after plain steps the draft lags by
    their tokens). Longer catch-ups (a new request's prompt) run eagerly. With ``cfg.draft_loop`` the
    proposer also gets ``loop_graphs``: drafts 2..k of a greedy propose in one replay
    (models/draft_loop.py; a shared-cache self-draft's whole propose), for up to ``max_batch`` rows and
    ``max_k`` steps.

    Returns None when graphs are off, or (logged) when the proposer has no ``graph_forward`` hook."""
    model, kv_cache = proposer.model, proposer.kv_cache
    if not cfg.uses_graphs(model.lm_head.weight.device):
        return None
    if not hasattr(proposer, "graph_forward"):
        logger.warning(
            "proposer %s has no graph_forward hook: its draft steps stay eager", type(proposer).__name__
        )
        return None
    max_q = 2 if getattr(proposer, "is_shared_kv", False) else cfg.draft_max_q
    buckets = decode_buckets(cfg.max_batch) + mqa_buckets(cfg.max_batch, max_q)
    runner = GraphRunner(
        model, kv_cache, buckets, cfg.max_blocks(block_size), proposer.num_layers, name="draft",
        graph_backend=cfg.backend, emulate=cfg.emulate, progress=cfg.progress, num_warmup=cfg.num_warmup,
    )  # fmt: skip
    proposer.graph_forward = GraphForward(runner)
    if cfg.draft_loop and cfg.max_k >= 1 and hasattr(proposer, "loop_graphs"):
        proposer.loop_graphs = DraftLoopGraphs(
            model, kv_cache, size_ladder(cfg.max_batch), cfg.max_k, cfg.max_blocks(block_size),
            proposer.num_layers, graph_backend=cfg.backend, emulate=cfg.emulate, progress=cfg.progress,
            num_warmup=cfg.num_warmup,
        )  # fmt: skip
    return proposer.graph_forward
