"""Scorer micro-benchmark: ms per scoring step per scorer over batch x k x context, next to the floor.

Floor = the bytes of weights one forward streams / the device copy bandwidth measured in the same
run (a copy of n bytes moves 2n: read + write). Requests share their prefix blocks physically (the
block tables point at the same blocks), so batch 128 x context 2048 x 32 layers fits in memory; the
attention reads the same number of bytes as with private prefixes. Each request owns the blocks
from the one holding its last cached token on, so the scored tokens' K/V writes never collide.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace

import torch

from specsched.bench.common import (
    copy_bandwidth,
    device_name,
    graph_config,
    median,
    random_model,
    streamed_weight_bytes,
    sync,
    time_ms,
)
from specsched.engine.request import Request, SamplingParams
from specsched.kernels.metadata import build_metadata
from specsched.kernels.pdl import pdl_args, pdl_enabled
from specsched.models.cuda_graphs import GraphRunner
from specsched.models.graph_buckets import decode_buckets
from specsched.proposers.base import Proposals
from specsched.scorers.graph import GraphForward, build_piecewise_runner, graph_runners_of
from specsched.scorers.mqa import MQAScorer
from specsched.scorers.registry import build_scorers

logger = logging.getLogger(__name__)


@dataclass
class ScorerRow:
    batch: int
    k: int
    context: int  # tokens per request: KV-cached prefix + the scored last token
    scorer: str
    ms: float  # median
    ms_min: float
    floor_ms: float
    path: str  # "graph", "eager", or "eager fallback: <reason>"
    error: str = ""

    @property
    def vs_floor(self) -> float:
        return self.ms / self.floor_ms if self.floor_ms else float("nan")


@dataclass
class DraftRow:
    model: str
    batch: int
    graph_ms: float  # one single-token draft step through the graphs
    eager_ms: float


def shared_prefix_batch(
    batch: int, k: int, context: int, block_size: int, first_block: int, vocab: int, seed: int, device
) -> tuple[list[Request], Proposals, int]:
    """``batch`` decoding requests of ``context`` tokens sharing blocks ``first_block ..`` for their
    common prefix; returns the requests, random drafts and the number of blocks used."""
    shared = (context - 1) // block_size  # full blocks before the first written position
    tail = -(-(context + k) // block_size) - shared
    nxt = first_block + shared
    reqs = []
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        table = list(range(first_block, first_block + shared)) + list(range(nxt, nxt + tail))
        nxt += tail
        r = Request(f"b{i}", [3] * context, SamplingParams(), block_table=table)
        r.num_computed = context - 1
        reqs.append(r)
    drafts = torch.randint(3, vocab, (batch, k), generator=g).tolist()
    return reqs, Proposals.from_lists(drafts, device), nxt - first_block


def run_scorer_bench(
    cfg, graphs_cfg, device: torch.device, dtype: torch.dtype, block_size: int, seed: int
) -> dict:
    """Rows of :class:`ScorerRow` (and draft-step rows) plus the floor; ``cfg`` is ``bench.scorers``."""
    model = random_model(cfg.model, device, dtype, seed)
    fused = bool(cfg.fused_linear)
    gemms = fused and bool(cfg.fused_linear_gemms)
    if fused:  # forwards of <= 16 rows take the fused small-M kernels (graphs capture them)
        model.set_fused_linear(True, gemms=gemms)
    with pdl_enabled(bool(cfg.get("pdl", False))):  # graphs keep the launch mode they were captured in
        return _run(cfg, graphs_cfg, model, device, dtype, block_size, seed, fused, gemms)


def _run(cfg, graphs_cfg, model, device, dtype, block_size, seed, fused: bool, gemms: bool) -> dict:
    shapes = [(b, k, c) for c in cfg.context for b in cfg.batch for k in cfg.k]
    shapes += [tuple(s) for s in (cfg.extra_shapes or []) if tuple(s) not in shapes]
    max_b, max_k = max(s[0] for s in shapes), max(s[1] for s in shapes)
    max_ctx = max(s[2] for s in shapes)
    weight_bytes = streamed_weight_bytes(model)
    bw = copy_bandwidth(device, cfg.copy_mib)
    floor_ms = weight_bytes / bw * 1e3
    logger.info(
        "floor: %.2f GB of weights / %.2f TB/s copy = %.3f ms", weight_bytes / 1e9, bw / 1e12, floor_ms
    )
    shared = (max_ctx - 1) // block_size
    num_blocks = 1 + shared + max_b * (-(-(max_ctx + max_k) // block_size) - shared + 1)
    kv = model.allocate_kv_cache(num_blocks, block_size)
    gcfg = graph_config(graphs_cfg, max_b, max_k, max_ctx + max_k + 1)
    scorers = build_scorers(list(cfg.scorers), model, kv, block_size, gcfg)
    pw_error = ""
    if cfg.get("piecewise") and "mqa" in scorers and gcfg.uses_graphs(device) and not fused:  # + eager row
        try:  # a capture that fails must not cost the other scorers' rows
            pw = build_piecewise_runner(model, kv, replace(gcfg, piecewise=True))
            scorers["mqa piecewise"] = MQAScorer(model, kv, block_size, pw)
        except Exception as e:
            logger.exception("piecewise graphs for the mqa scorer failed")
            pw_error = f"{type(e).__name__}: {e}"[:300]
    runners = graph_runners_of(scorers)
    rows: list[ScorerRow] = []
    for b, k, c in shapes:
        reqs, props, _ = shared_prefix_batch(b, k, c, block_size, 1, model.cfg.vocab_size, seed, device)
        for name, scorer in scorers.items():
            before = {id(r): sum(r.fallback_reasons.values()) for r in runners}
            pw = getattr(scorer, "piecewise", None)
            pw_before = pw.num_eager_fallbacks if pw is not None else 0
            try:
                step = lambda s=scorer, r=reqs, p=props: s.score(r, p)  # noqa: E731
                times = time_ms(step, device, cfg.warmup, cfg.iters)
            except Exception as e:  # one bad shape must not stop the grid
                logger.exception("scorer %s at batch %d k %d context %d failed", name, b, k, c)
                rows.append(ScorerRow(b, k, c, name, float("nan"), float("nan"), floor_ms, "error", repr(e)))
                continue
            path = "graph" if hasattr(scorer, "runner") else "eager"
            if pw is not None:
                path = "piecewise" if pw.num_eager_fallbacks == pw_before else "eager fallback: tokens"
            for r in runners:
                if getattr(scorer, "runner", None) is r and sum(r.fallback_reasons.values()) > before[id(r)]:
                    path = "eager fallback: " + ", ".join(r.fallback_reasons)
            rows.append(ScorerRow(b, k, c, name, median(times), min(times), floor_ms, path))
            logger.info("scorer %-16s batch %3d k %d ctx %5d: %.3f ms (%s)", name, b, k, c, rows[-1].ms, path)
        if pw_error:  # the row says why it has no numbers
            nan = float("nan")
            rows.append(ScorerRow(b, k, c, "mqa piecewise", nan, nan, floor_ms, "error", pw_error))
    graph_stats = [r.stats() for r in runners]
    graph_stats += [s.piecewise.stats() for s in scorers.values() if getattr(s, "piecewise", None)]
    del scorers, runners, kv
    draft_rows = []
    if cfg.draft_model:
        draft_rows = draft_step_bench(cfg, graphs_cfg, device, dtype, block_size, seed)
    sync(device)
    return {
        "device": device_name(device),
        "model": cfg.model,
        "fused_linear": "with its output / down GEMMs" if gemms else fused,
        "pdl": pdl_args(device)["USE_PDL"],  # on and effective here
        "dtype": str(dtype).replace("torch.", ""),
        "weight_bytes": weight_bytes,
        "copy_bandwidth": bw,
        "floor_ms": floor_ms,
        "rows": [asdict(r) | {"vs_floor": r.vs_floor} for r in rows],
        "draft_rows": [asdict(r) for r in draft_rows],
        "graphs": graph_stats,
    }


def draft_step_bench(cfg, graphs_cfg, device, dtype, block_size: int, seed: int) -> list[DraftRow]:
    """One single-token step of the draft model (``cfg.draft_model``) per batch: graph vs eager."""
    model = random_model(cfg.draft_model, device, dtype, seed + 1)
    max_b, ctx = max(cfg.draft_batch), 512
    blocks_per = -(-(ctx + 1) // block_size)
    kv = model.allocate_kv_cache(1 + max_b * blocks_per, block_size)
    if not (graphs_cfg.enabled and (device.type == "cuda" or graphs_cfg.emulate)):
        return []
    runner = GraphRunner(
        model, kv, decode_buckets(max_b), blocks_per, emulate=bool(graphs_cfg.emulate),
        progress=bool(graphs_cfg.progress), name="draft",
    )  # fmt: skip
    fwd = GraphForward(runner)
    out = []
    for b in cfg.draft_batch:
        tables = [list(range(1 + i * blocks_per, 1 + (i + 1) * blocks_per)) for i in range(b)]
        meta = build_metadata([1] * b, [ctx] * b, tables, block_size, device)
        ids = torch.full((b,), 3, dtype=torch.int64, device=device)
        pos = torch.full((b,), ctx - 1, dtype=torch.int64, device=device)
        last = torch.arange(b, device=device)
        args = (ids, pos, meta, kv, last)
        with torch.inference_mode():
            graph = median(time_ms(lambda a=args: fwd(*a), device, cfg.warmup, cfg.iters))
            eager = median(time_ms(lambda a=args: model(*a), device, cfg.warmup, cfg.iters))
        out.append(DraftRow(cfg.draft_model, b, graph, eager))
    return out
