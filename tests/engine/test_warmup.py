"""Start-up kernel warm-up: what it runs, that it leaves serving exactly as it was (it writes only the
pad block), and (GPU) that serving after it builds no Triton variant."""

from __future__ import annotations

import random

import pytest
import torch

from specsched.engine.config import (
    CacheConfig,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from specsched.engine.engine import Engine
from specsched.engine.request import SamplingParams
from specsched.engine.warmup import forward_shapes, is_warmup_on, serving_domain
from specsched.kernels.attention_variants import AttentionDomain
from specsched.models.graph_buckets import token_buckets


def config(warmup: str, device: str = "cpu", dtype: str = "float32", **spec) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(source="tiny", device=device, dtype=dtype, kernel_warmup=warmup),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48),
        spec=SpecConfig(max_k=4, **spec),
        policy={"name": "fixed", "k": 3, "scorer": "mqa"},
    )


def test_warm_up_is_on_cuda_by_default_and_validated():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not is_warmup_on(config("auto"), cpu) and is_warmup_on(config("auto"), cuda)
    assert is_warmup_on(config("on"), cpu) and not is_warmup_on(config("off"), cuda)
    with pytest.raises(ValueError, match="model.kernel_warmup must be auto, on or off, got 'yes'"):
        ModelConfig(kernel_warmup="yes")


def test_serving_domain_and_forward_shapes_cover_the_engines_launches():
    cfg = config("on")
    engine = Engine(cfg)
    d = serving_domain(cfg, engine.model, engine.max_model_len)
    assert d.max_rows_single >= 4 * (4 + 1) and d.max_rows_multi >= 4  # batch expansion rows, MQA rows
    assert d.max_q == 48 and d.max_keys == engine.max_model_len
    shapes = forward_shapes(AttentionDomain(9, 3, 64, 320, 64, 2048, 8192))
    assert (1, 1) in shapes and (1, 2048) in shapes and (320, 1) in shapes  # both ends of both ladders
    assert all(q <= 2048 for _, q in shapes) and all(r <= 320 for r, _ in shapes)
    # every token count an eager forward is padded to on CUDA is warmed up (its GEMM shapes)
    assert {q for r, q in shapes if r == 1} == set(token_buckets(2048))


def test_warm_up_on_cpu_runs_the_forwards_and_changes_no_output():
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 60))] for _ in range(6)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True) for _ in prompts]
    cold, warm = Engine(config("off", proposer="ngram")), Engine(config("on", proposer="ngram"))
    assert cold.warmup is None
    report = warm.warmup
    assert report is not None and report.num_forwards == len(forward_shapes(serving_domain(
        warm.cfg, warm.model, warm.max_model_len)))  # fmt: skip
    assert report.num_attention_configs == 0  # the torch backend on CPU: no Triton attention
    assert report.num_variants == 0  # nothing compiles on CPU
    assert warm.generate(prompts, params) == cold.generate(prompts, params)
    assert warm.num_free_blocks == warm.num_total_blocks  # the warm-up reserved nothing


def test_draft_models_lists_each_separate_draft_once_wrapped_or_not():
    """The synthetic proposer paying a real draft's cost wraps it (``.draft``): the warm-up must find
    that model too (the regret bench's 7B pair met its draft's variants inside timed windows); a
    self-draft is the target's own layers and is not warmed twice."""
    from specsched.engine.config import NgramConfig
    from specsched.engine.warmup import draft_models, warm_up_engine
    from specsched.models.loader import load_model
    from specsched.proposers.draft import DraftModelProposer
    from specsched.proposers.ngram import NgramProposer
    from specsched.proposers.synthetic import SyntheticProposer

    target = load_model(ModelConfig(source="tiny", dtype="float32", seed=0), progress=False).model
    draft = load_model(ModelConfig(source="tiny", dtype="float32", seed=1), progress=False).model
    dkv = draft.allocate_kv_cache(32, 4)
    drafter = DraftModelProposer(draft, dkv, 4)
    self_draft = DraftModelProposer(target, target.allocate_kv_cache(32, 4, 1), 4, num_layers=1)
    synth = SyntheticProposer(target, 0.5, 4, draft=drafter)
    ngram = NgramProposer(NgramConfig(), torch.device("cpu"))
    found = draft_models(target, [ngram, self_draft, synth, drafter])
    assert [(m, kv) for m, kv in found] == [(draft, dkv)]
    assert draft_models(target, [ngram, self_draft]) == []

    from types import SimpleNamespace

    cfg = config("on")
    kv = target.allocate_kv_cache(32, 4)
    parts = SimpleNamespace(model=target, kv_cache=kv, device=torch.device("cpu"),
                            proposers={"synthetic": synth}, max_model_len=128)  # fmt: skip
    report = warm_up_engine(cfg, parts)
    per_model = len(forward_shapes(serving_domain(cfg, target, 128)))
    assert report is not None and report.num_forwards == 2 * per_model  # the target's, the draft's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_gpu_serving_after_the_warm_up_builds_no_variant(proposer):
    from specsched.kernels.compile_watch import compile_watch

    watch = compile_watch()
    spec = {"draft": DraftConfig(source="tiny", seed=3)} if proposer == "draft" else {}
    cfg = config("auto", device="cuda", dtype="bfloat16", proposer=proposer,
                 scorers=["batch_expansion", "mqa", "mqa_graph"], **spec)  # fmt: skip
    cfg.policy = {"name": "goodput"}
    engine = Engine(cfg)
    assert engine.warmup is not None and engine.warmup.num_forwards > 0
    watch.mark_ready()
    before = watch.num_after_ready
    rng = random.Random(7)
    for n in (1, 3, 4):  # batches of mixed prompt lengths (new prefill shapes) and k
        prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 120))] for _ in range(n)]
        engine.generate(
            prompts, [SamplingParams(max_tokens=rng.randint(4, 40), ignore_eos=True) for _ in prompts]
        )
    print(
        "built at start-up:",
        watch.num_built - watch.num_after_ready,
        "after:",
        watch.num_after_ready - before,
    )
    assert watch.num_after_ready == before, [e.signature for e in watch.after_ready()]


_COLD_START = """
import glob, json, os
from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.warmup import prebuild_attention
from specsched.models.loader import load_model

cfg = EngineConfig(
    model=ModelConfig(source="tiny", device="cuda", dtype="bfloat16"),
    cache=CacheConfig(block_size=4, num_blocks=256),
    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48),
    spec=SpecConfig(max_k=4, proposer="ngram", scorers=["batch_expansion", "mqa", "mqa_graph"]),
    policy={"name": "goodput"},
)

def attention_entries():
    root = os.environ["TRITON_CACHE_DIR"]
    return sorted(p[len(root):] for p in glob.glob(root + "/*/_paged_attn_kernel.cubin")
                  + glob.glob(root + "/*/_combine_splits_kernel.cubin"))

model = load_model(cfg.model).model
max_len = min(cfg.model.max_model_len or model.cfg.max_position, model.cfg.max_position)
pre = prebuild_attention(cfg, [model], max_len, 3)
by_workers = attention_entries()
engine = Engine(cfg)  # SPECSCHED_COMPILE_WORKERS=1: its own warm-up and capture, in this process
print(json.dumps({"complete": pre.is_complete, "launched": pre.num_launched,
                  "configs": engine.warmup.num_attention_configs, "by_workers": by_workers,
                  "after_engine": attention_entries()}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_parallel_build_leaves_no_attention_variant_to_compile(tmp_path):
    """A cold start (empty Triton cache): the worker processes compile every attention variant, so
    the engine's own warm-up and graph capture compile none (they load the workers' from disk)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "SPECSCHED_COMPILE_WORKERS": "1"}
    proc = subprocess.run([sys.executable, "-c", _COLD_START], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["complete"] and out["launched"] == out["configs"] > 0
    assert out["by_workers"], "the workers wrote no attention kernel to the cache"
    assert out["after_engine"] == out["by_workers"]


def test_deterministic_mode_warms_up_its_two_attention_configs_only():
    from types import SimpleNamespace

    from specsched.engine.warmup import _attention_configs
    from specsched.kernels.triton_attention import deterministic_launch_configs

    d = AttentionDomain(9, 3, 64, max_rows_single=64, max_rows_multi=64, max_q=512, max_keys=2048)
    head = SimpleNamespace(weight=torch.zeros(1))
    model = SimpleNamespace(lm_head=head, attn_backend="triton", deterministic=True)
    assert _attention_configs(model, d) == deterministic_launch_configs(3, 64)
    model.deterministic = False  # the default mode: every config of the serving domain
    assert len(_attention_configs(model, d)) > 2


# ---- start-up times -----------------------------------------------------------------------------------


def test_startup_times_mark_in_order_from_the_process_start(monkeypatch):
    import time

    from specsched.engine import warmup
    from specsched.engine.warmup import StartupTimes, process_age_s

    age = process_age_s()
    assert age is not None and 0.0 < age < time.monotonic()  # Linux CI: /proc is there
    times = StartupTimes.since_process_start()
    assert times.clock == "proc"
    first = times.mark("imports")
    assert first >= age - 0.05  # seconds from the process's start, not from the object's
    times.mark("weights")
    times.mark("listening")
    reached = times.reached()
    assert list(reached) == ["imports_s", "weights_s", "listening_s"]  # field order = start-up order
    assert list(reached.values()) == sorted(reached.values()) and times.total_s == times.listening_s
    line = times.describe()
    assert line.startswith(f"start-up {times.total_s:.2f} s from process start (clock proc): imports ")
    assert "weights " in line and "tokenizer" not in line  # only the milestones reached
    times.conversion = "hit"
    assert "weights (conversion cache hit) " in times.describe()
    assert times.to_dict()["conversion"] == "hit" and times.to_dict()["tokenizer_s"] is None
    with pytest.raises(ValueError, match="unknown start-up milestone 'coffee'; known: imports, config"):
        times.mark("coffee")
    # without /proc: from the entry point's own first reading
    monkeypatch.setattr(warmup, "process_age_s", lambda: None)
    origin = time.monotonic() - 2.0
    fallback = StartupTimes.since_process_start(origin)
    assert fallback.clock == "main" and 2.0 <= fallback.mark("imports") < 10.0


def test_build_parts_marks_the_engines_milestones():
    from specsched.engine.components import build_parts
    from specsched.engine.warmup import StartupTimes

    cfg = config("on", proposer="ngram")
    times = StartupTimes.since_process_start()
    times.mark("config")
    engine = Engine(cfg, build_parts(cfg, startup=times))
    assert engine.warmup is not None
    reached = times.reached()
    assert list(reached) == ["config_s", "weights_s", "prebuild_s", "kv_cache_s", "graphs_s", "warmup_s"]
    assert list(reached.values()) == sorted(reached.values())
    assert times.conversion == "none" and times.tokenizer_s is None  # a preset: nothing converted
