"""Kernel warm-up at start-up: build every Triton variant the engine can launch before it serves.

Two passes per model (the target, and a separate draft model when there is one):

1. attention: every launch config of the serving domain (:mod:`specsched.kernels.attention_variants`),
   one dummy launch each;
2. forwards: the model's own forward over a ladder of token counts and rows (one-row prefill chunks
   and many-row decode batches) on the pad block, which builds the RMSNorm, rotary + KV store and
   SiLU-mul variants, and loads the GEMM kernels cuBLAS would otherwise load on first use.

On a cold start the attention configs are first compiled in parallel worker processes
(:func:`prebuild_attention`, before graph capture; :mod:`specsched.kernels.parallel_build`), which
fill Triton's on-disk cache, so the warm-up, and graph capture, load them instead of compiling them
one after the other. Graph capture (at scorer build) replays the same kernels. Afterwards the
daemon marks the compile watch ready (:mod:`specsched.kernels.compile_watch`); a variant built later
is counted and named in a warning. Nothing is compiled off CUDA (torch kernels there; the
interpreter compiles nothing), so the warm-up does nothing on CPU.

:class:`StartupTimes` is the whole start-up's breakdown (process start to listening), of which the
warm-up is one milestone.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from specsched.engine.config import EngineConfig
from specsched.kernels.compile_watch import compile_watch
from specsched.kernels.metadata import build_metadata
from specsched.models.graph_buckets import token_buckets
from specsched.models.llama import KVCache, LlamaForCausalLM

if TYPE_CHECKING:
    from specsched.kernels.attention_variants import AttentionDomain
    from specsched.kernels.parallel_build import ParallelBuildReport

logger = logging.getLogger(__name__)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class WarmupReport:
    num_variants: int = 0  # Triton variants built during the warm-up (compiled or loaded from disk)
    num_attention_configs: int = 0  # attention launch configs launched
    num_forwards: int = 0
    seconds: float = 0.0
    num_prebuilt: int = 0  # attention configs compiled beforehand by worker processes
    num_prebuild_workers: int = 0
    prebuild_seconds: float = 0.0

    def describe(self) -> str:
        text = (
            f"kernel warm-up: {self.num_variants} Triton variants built ({self.num_attention_configs} "
            f"attention launch configs, {self.num_forwards} forwards) in {self.seconds:.1f} s"
        )
        if self.num_prebuild_workers:
            text += (f", after {self.num_prebuilt} attention variants compiled in {self.num_prebuild_workers}"
                     f" processes in {self.prebuild_seconds:.1f} s")  # fmt: skip
        return text


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: ``/proc/self/stat`` starttime against
    ``/proc/uptime``, 10 ms resolution), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:  # comm (field 2) may hold spaces: split after its ')'
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return age if 0.0 <= age < 86400.0 else None


@dataclass
class StartupTimes:
    """Seconds from the process's start to each start-up milestone, in the order they are reached
    (None: not part of this start, e.g. no tokenizer, no separate draft model). ``clock``: ``proc`` =
    the process's start time from /proc (interpreter start included), ``main`` = ``origin`` given by
    the entry point (its first statement) where /proc is not available. :meth:`mark` records one."""

    clock: str = "proc"
    conversion: str = "none"  # the target's conversion cache: hit | built | none (nothing to convert)
    imports_s: float | None = None  # the entry point's module imports (torch, hydra, zmq) done
    config_s: float | None = None  # hydra config composed and validated
    weights_s: float | None = None  # target weights on the device (through the conversion cache)
    tokenizer_s: float | None = None
    draft_s: float | None = None  # a separate draft model loaded
    prebuild_s: float | None = None  # attention kernels compiled in worker processes (CUDA, cold)
    kv_cache_s: float | None = None  # KV cache sized and allocated
    graphs_s: float | None = None  # scorers and proposers built: every CUDA graph captured
    warmup_s: float | None = None  # kernel warm-up (WarmupReport)
    log_s: float | None = None  # engine built, decision log's run row written (when there is a log)
    listening_s: float | None = None  # socket bound, serving threads started

    def __post_init__(self) -> None:
        self._origin = time.monotonic()  # monotonic time of the process's start (or of ``origin``)

    @classmethod
    def since_process_start(cls, origin: float | None = None) -> StartupTimes:
        """Times from the process's start; from ``origin`` (a ``time.monotonic()``) without /proc."""
        age, now = process_age_s(), time.monotonic()
        times = cls(clock="proc" if age is not None else "main")
        times._origin = now - age if age is not None else (origin if origin is not None else now)
        return times

    def mark(self, milestone: str) -> float:
        """Record ``milestone`` (a field name without ``_s``) as reached now; returns its seconds."""
        name, known = f"{milestone}_s", self.milestones()
        if name not in known:
            names = ", ".join(n.removesuffix("_s") for n in known)
            raise ValueError(f"unknown start-up milestone {milestone!r}; known: {names}")
        setattr(self, name, round(time.monotonic() - self._origin, 3))
        return getattr(self, name)

    @staticmethod
    def milestones() -> list[str]:
        return [f.name for f in fields(StartupTimes) if f.name.endswith("_s")]

    @property
    def total_s(self) -> float:
        """Seconds from the process's start to the last milestone reached (listening, once it is)."""
        return max(self.reached().values(), default=0.0)

    def reached(self) -> dict[str, float]:
        return {n: getattr(self, n) for n in self.milestones() if getattr(self, n) is not None}

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def describe(self) -> str:
        """One line: the total, then each phase's own seconds in the order reached."""
        parts, prev = [], 0.0
        for name, at in self.reached().items():
            label = name.removesuffix("_s")
            if label == "weights" and self.conversion != "none":
                label += f" (conversion cache {self.conversion})"
            parts.append(f"{label} {at - prev:.2f}")
            prev = at
        return f"start-up {self.total_s:.2f} s from process start (clock {self.clock}): " + ", ".join(parts)


def is_warmup_on(cfg: EngineConfig, device: torch.device) -> bool:
    mode = cfg.model.kernel_warmup
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def serving_domain(cfg: EngineConfig, model: LlamaForCausalLM, max_model_len: int) -> AttentionDomain:
    """The attention launches of serving ``cfg``: batch-expansion rows up to max_num_seqs x (max_k + 1)
    and multi-query rows up to max_num_seqs (each rounded up to a power of two: graph buckets pad
    up to it), queries up to the prefill chunk, keys up to max_model_len."""
    from specsched.kernels.attention_variants import AttentionDomain  # triton: imported on CUDA only

    seqs, k = cfg.scheduler.max_num_seqs, cfg.spec.max_k
    mc = model.cfg
    return AttentionDomain(
        num_heads=mc.num_heads, kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        max_rows_single=_pow2(seqs * (k + 1)),
        max_rows_multi=_pow2(seqs),
        max_q=max(cfg.scheduler.max_num_batched_tokens, k + 1),
        max_keys=max_model_len,
    )  # fmt: skip


def forward_shapes(domain: AttentionDomain) -> list[tuple[int, int]]:
    """(rows, query length per row) of the warm-up forwards: one row per token bucket up to the
    largest eager forward (a prefill chunk, or eager scoring of every row). On CUDA eager forwards
    are padded to these token counts (``models.graph_buckets.token_bucket``), so these are all the
    GEMM shapes serving meets outside the graphs; plus a few many-row single-query batches."""
    chunks = [(1, t) for t in token_buckets(max(domain.max_q, domain.max_rows_single))]
    top = domain.max_rows_single
    rows = [r for r in (2, 3, 8, 17, 64, top) if r <= top]
    return chunks + [(r, 1) for r in sorted(set(rows))]


def _attention_configs(model: LlamaForCausalLM, domain: AttentionDomain) -> list:
    dev = model.lm_head.weight.device
    if model.attn_backend != "triton":
        return []
    if model.deterministic:  # fixed tiles and split points: the same two configs at every shape
        from specsched.kernels.attention_config import deterministic_launch_configs

        return deterministic_launch_configs(domain.group, domain.head_dim)
    from specsched.kernels.attention_variants import launch_configs

    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132
    return list(launch_configs(domain, num_sms))


def prebuild_attention(
    cfg: EngineConfig, models: list[LlamaForCausalLM], max_model_len: int, num_workers: int
) -> ParallelBuildReport | None:
    """Compile the attention variants of each model's serving domain in ``num_workers`` processes
    (CUDA, Triton backend, warm-up on, ``num_workers`` > 1; else None), before graph capture."""
    from specsched.kernels.parallel_build import CacheShape, ParallelBuildReport, build_in_workers
    from specsched.kernels.pdl import is_pdl_enabled, pdl_mode

    jobs = []
    for model in models:
        dev = model.lm_head.weight.device
        if not is_warmup_on(cfg, dev) or dev.type != "cuda" or num_workers <= 1:
            continue
        configs = _attention_configs(model, serving_domain(cfg, model, max_model_len))
        mc = model.cfg
        shape = CacheShape(mc.num_heads, mc.num_kv_heads, mc.head_dim, cfg.cache.block_size,
                           str(model.lm_head.weight.dtype).removeprefix("torch."), str(dev),
                           is_pdl_enabled(), pdl_mode().trigger == "before")  # fmt: skip
        if configs:
            jobs.append((shape, configs))
    if not jobs:
        return None
    total, cached = ParallelBuildReport(num_workers=num_workers), []
    desc = f"compiling attention kernels ({num_workers} processes)"
    with tqdm(total=sum(len(c) for _, c in jobs), desc=desc, unit="variant", leave=False) as bar:
        for shape, configs in jobs:
            r = build_in_workers(configs, shape, num_workers, bar.update)
            cached.append(r.is_cached)
            total.num_configs += r.num_configs
            total.num_launched += r.num_launched
            total.seconds += r.seconds
            total.failures += r.failures
    if all(r_cached for r_cached in cached):
        total.num_workers = 0
        logger.info("parallel kernel build: skipped (%d attention variants built by an earlier start)",
                    total.num_configs)  # fmt: skip
        return total
    logger.info(
        "parallel kernel build: %d of %d attention variants in %d processes in %.1f s",
        total.num_launched, total.num_configs, num_workers, total.seconds,
    )  # fmt: skip
    return total


@torch.inference_mode()
def _warm_up_forwards(
    model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, shapes: list[tuple[int, int]], bar
) -> None:
    dev = model.lm_head.weight.device
    for rows, q in shapes:
        blocks = -(-q // block_size)
        meta = build_metadata([q] * rows, [q] * rows, [[0] * blocks for _ in range(rows)], block_size, dev)
        positions = torch.arange(q, device=dev).repeat(rows)
        ids = torch.zeros(rows * q, dtype=torch.int64, device=dev)
        last = torch.arange(q - 1, rows * q, q, device=dev)
        model(ids, positions, meta, kv_cache, last)
        bar.update(1)


def warm_up_model(
    model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, domain: AttentionDomain, name: str
) -> WarmupReport:
    """Build ``model``'s kernel variants for ``domain``; returns what was built (also logged)."""
    watch = compile_watch()
    dev = model.lm_head.weight.device
    t0, built0 = time.perf_counter(), watch.num_built
    configs = _attention_configs(model, domain)
    shapes = forward_shapes(domain)
    with tqdm(total=len(configs) + len(shapes), desc=f"kernel warm-up ({name})", unit="variant",
              leave=False) as bar:  # fmt: skip
        if configs:
            from specsched.kernels.attention_variants import warm_up_attention

            k_cache, v_cache = kv_cache[0]
            warm_up_attention(configs, k_cache, v_cache, domain.num_heads, domain.head_dim**-0.5, bar.update)
        _warm_up_forwards(model, kv_cache, block_size, shapes, bar)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    report = WarmupReport(watch.num_built - built0, len(configs), len(shapes), time.perf_counter() - t0)
    logger.debug("%s: %s", name, report.describe())
    return report


def draft_models(target: LlamaForCausalLM, proposers) -> list[tuple[LlamaForCausalLM, KVCache]]:
    """The separate draft models of ``proposers`` (each one's ``draft_model()``: a draft-model
    proposer's, or the real draft a synthetic proposer pays for), each once, with its KV cache; a
    self-draft (the target's own layers) is the target's and not listed."""
    out, seen = [], {id(target)}
    for p in proposers:
        found = p.draft_model()
        if found is not None and id(found[0]) not in seen:
            seen.add(id(found[0]))
            out.append(found)
    return out


def warm_up_engine(
    cfg: EngineConfig, parts, prebuilt: ParallelBuildReport | None = None
) -> WarmupReport | None:
    """The target's warm-up, then a separate draft model's (``parts``: the engine's EngineParts;
    ``prebuilt``: what :func:`prebuild_attention` did before). None when the warm-up is off
    (``model.kernel_warmup``; auto = on CUDA)."""
    if not is_warmup_on(cfg, parts.device):
        return None
    bs = cfg.cache.block_size
    domain = serving_domain(cfg, parts.model, parts.max_model_len)
    total = warm_up_model(parts.model, parts.kv_cache, bs, domain, "target")
    for model, kv_cache in draft_models(parts.model, parts.proposers.values()):
        d = warm_up_model(model, kv_cache, bs, serving_domain(cfg, model, parts.max_model_len), "draft")
        total = WarmupReport(total.num_variants + d.num_variants, total.num_attention_configs +
                             d.num_attention_configs, total.num_forwards + d.num_forwards,
                             total.seconds + d.seconds)  # fmt: skip
    if prebuilt is not None:
        total.num_prebuilt, total.num_prebuild_workers = prebuilt.num_launched, prebuilt.num_workers
        total.prebuild_seconds = prebuilt.seconds
    logger.info("%s", total.describe())
    return total
