"""Shared benchmark plumbing: device, fast random models, timing, the copy-bandwidth floor, engines."""

from __future__ import annotations

import logging
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specsched.engine.components import EngineParts
from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.models.config import get_preset
from specsched.models.llama import KVCache, LlamaForCausalLM, rope_inv_freq
from specsched.models.loader import resolve_attn_backend
from specsched.models.random_init import make_decisive
from specsched.policies.acceptance import AcceptanceEstimator
from specsched.policies.base import Policy
from specsched.policies.cost_model import CostModels
from specsched.proposers.base import Proposer
from specsched.scorers.base import Scorer
from specsched.scorers.graph import GraphConfig, graph_buckets_of

if TYPE_CHECKING:
    from specsched.engine.warmup import WarmupReport
    from specsched.models.cuda_graphs import GraphRunner

logger = logging.getLogger(__name__)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def random_model(
    preset: str, device: torch.device, dtype: torch.dtype, seed: int = 0, is_decisive: bool = True
) -> LlamaForCausalLM:
    """A random-init preset built directly on ``device`` (a 7B model in seconds: the weights are drawn
    by the device's generator, not on the CPU). Timing only: not the loader's seeded weights."""
    cfg = get_preset(preset)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, resolve_attn_backend("auto", device))
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = 0.1 if preset == "tiny" else 0.02
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    if is_decisive and preset != "tiny":  # keep synthetic requests on their oracle path in bf16
        make_decisive(model, seed)
    return model.requires_grad_(False).eval()


def streamed_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the weights one forward streams: every parameter but the embedding table (only its
    looked-up rows are read), unless it doubles as the LM head."""
    embed = model.model.embed_tokens.weight
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or (p is embed and model.lm_head.weight is not embed):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls after ``warmup`` calls. Each call starts on an idle
    device (synchronised) and is timed to the end of its device work, so it is the latency a step
    sees: host work (launches, metadata) plus the device tail. CUDA events on GPU."""
    for _ in range(warmup):
        fn()
    out = []
    if device.type == "cuda":
        events = []
        for _ in range(iters):
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in events]
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def copy_bandwidth(device: torch.device, mib: int, iters: int = 5) -> float:
    """Device copy bandwidth in bytes/s, counting read + write (a copy of n bytes moves 2n)."""
    n = max(1, mib) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = median(time_ms(lambda: dst.copy_(src), device, warmup=2, iters=iters))
    return 2 * n / (ms / 1e3)


@dataclass
class EngineSpec:
    """What one benchmark engine is made of (model, caches and graphs are shared between engines)."""

    model: LlamaForCausalLM
    kv_cache: KVCache
    num_blocks: int
    block_size: int
    scorers: dict[str, Scorer]
    max_batch: int
    max_k: int
    max_model_len: int
    eos_token_ids: list[int]
    tokenizer: object | None = None
    name: str = "model"
    scheduler: dict = field(default_factory=dict)  # SchedulerConfig overrides (bench.regret.scheduler)
    prefill_runner: GraphRunner | None = None  # prefill chunks on graphs, as the daemon's (None: eager)


def make_engine(
    spec: EngineSpec,
    proposers: dict[str, Proposer],
    default_proposer: str,
    policy: Policy,
    scheduler: dict | None = None,
) -> Engine:
    """A fresh engine (scheduler, cost models, acceptance) over shared model/caches/graphs;
    ``scheduler``: SchedulerConfig overrides of this engine alone, over the spec's."""
    return Engine(*_config_and_parts(spec, proposers, default_proposer, policy, scheduler))


def scheduler_config(spec: EngineSpec, scheduler: dict | None = None) -> SchedulerConfig:
    """The scheduler of an engine of ``spec`` with ``scheduler`` overrides (:func:`make_engine`)."""
    options = {"max_num_seqs": spec.max_batch, "max_num_batched_tokens": 4096, **spec.scheduler}
    return SchedulerConfig(**{**options, **(scheduler or {})})


def _config_and_parts(
    spec: EngineSpec,
    proposers: dict[str, Proposer],
    default_proposer: str,
    policy: Policy,
    scheduler: dict | None = None,
) -> tuple[EngineConfig, EngineParts]:
    device = spec.model.lm_head.weight.device
    cfg = EngineConfig(
        model=ModelConfig(source=spec.name, device=str(device)),
        cache=CacheConfig(block_size=spec.block_size, num_blocks=spec.num_blocks),
        scheduler=scheduler_config(spec, scheduler),
        spec=SpecConfig(proposer=default_proposer, scorers=list(spec.scorers), max_k=spec.max_k),
        policy={"name": policy.name},
    )
    parts = EngineParts(
        model=spec.model, tokenizer=spec.tokenizer, kv_cache=spec.kv_cache, num_blocks=spec.num_blocks,
        proposers=proposers, scorers=spec.scorers, policy=policy,
        costs=CostModels(graph_buckets_of(spec.scorers), device="cuda" if device.type == "cuda" else "cpu"),
        acceptance=AcceptanceEstimator(), model_name=spec.name, device=device,
        max_model_len=spec.max_model_len, eos_token_ids=spec.eos_token_ids,
        prefill_runner=spec.prefill_runner,
    )  # fmt: skip
    return cfg, parts


def warm_up_spec(spec: EngineSpec, proposers: dict[str, Proposer]) -> WarmupReport | None:
    """The daemon's start-up kernel warm-up for a bench's engines (:func:`warm_up_engine`: every
    attention launch config and forward token bucket of the target and of each separate draft model
    among ``proposers``, attention compiled first in worker processes on a cold cache), so that a
    timed window meets no kernel variant the daemon would have built before serving (H100,
    2026-12-05: one regret window of goodput spent 624 ms in one draft catch-up). None off CUDA."""
    from specsched.engine.settings import load_settings
    from specsched.engine.warmup import draft_models, prebuild_attention, warm_up_engine
    from specsched.policies.fixed import FixedConfig, FixedPolicy

    name = next(iter(proposers))
    cfg, parts = _config_and_parts(spec, proposers, name, FixedPolicy(FixedConfig(k=0)))
    models = [spec.model] + [m for m, _ in draft_models(spec.model, proposers.values())]
    prebuilt = prebuild_attention(cfg, models, spec.max_model_len, load_settings().num_compile_workers)
    return warm_up_engine(cfg, parts, prebuilt)


def graph_config(cfg, max_batch: int, max_k: int, max_model_len: int) -> GraphConfig:
    """The bench's ``graphs`` section as a :class:`GraphConfig` for one model: prefill chunks of up to
    ``graphs.prefill_tokens`` tokens (0: eager) and 16 prompts (within ``max_batch``), as the
    daemon's defaults (``GraphConfig.for_engine``)."""
    return GraphConfig(
        enabled=bool(cfg.enabled), max_batch=max_batch, max_k=max_k, max_model_len=max_model_len,
        emulate=bool(cfg.emulate), progress=bool(cfg.progress),
        prefill_rows=min(GraphConfig.prefill_rows, max_batch),
        prefill_tokens=int(cfg.get("prefill_tokens", 0)),
    )  # fmt: skip


def random_prompts(vocab: int, num: int, length: int, seed: int, motif: bool = False) -> list[list[int]]:
    """Token-id prompts (ids >= 3 avoid BOS/EOS); ``motif``: a repeated random motif (n-gram food)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        if motif:
            m = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
            out.append((m * (length // len(m) + 1))[:length])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(length)])
    return out


def blocks_for(num_requests: int, tokens_per_request: int, block_size: int) -> int:
    """KV blocks for the requests plus the reserved pad block and a little slack."""
    return 1 + num_requests * (-(-tokens_per_request // block_size) + 1)
