"""Greedy speculative output == non-speculative output when every step picks its scorer (batch
expansion, eager MQA, MQA graph) and each request's k (0..8) at random, and under the goodput policy:
in float32 on CPU (emulated graphs) and on CUDA (captured graphs). A stale graph input or a cache
slot written by one scorer and read wrongly by another would show here; bf16 rounding cannot."""

from __future__ import annotations

import random

import pytest
import torch

from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.request import SamplingParams
from specsched.policies.base import BatchView, Plan, Policy
from specsched.policies.registry import build_policy

SCORERS = ["batch_expansion", "mqa", "mqa_graph"]


class RandomPlan(Policy):
    name = "random_plan"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def decide(self, view: BatchView, costs) -> Plan:
        k = [self.rng.randint(0, r.max_k) for r in view.requests]
        return Plan(k, self.rng.choice(SCORERS), self.name)


def engine(device: str, proposer: str, graphs: bool) -> Engine:
    cfg = EngineConfig(
        model=ModelConfig(
            source="tiny", device=device, dtype="float32", cuda_graphs=graphs, kernel_warmup="off"
        ),
        cache=CacheConfig(block_size=16, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        spec=SpecConfig(proposer=proposer, scorers=SCORERS if proposer != "none" else ["mqa"], max_k=8),
        policy={"name": "fixed", "k": 0, "scorer": "mqa"},
    )  # fmt: skip
    return Engine.from_config(cfg)


def motif_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Repeating motifs: the n-gram proposer finds matches, so k reaches 8 and drafts are accepted."""
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 250) for _ in range(rng.randint(3, 9))]
        out.append((motif * 30)[: rng.randint(16, 80)])
    return out


def check(device: str, policy: str, seed: int) -> set[str]:
    rng = random.Random(seed)
    prompts = motif_prompts(rng, 6)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    base = engine(device, "none", graphs=False)
    want_alone = [base.generate([p], params)[0] for p in prompts]
    want_batch = base.generate(prompts, params)
    spec = engine(device, "ngram", graphs=True)
    spec.policy = RandomPlan(seed) if policy == "random" else build_policy({"name": policy})
    used: set[str] = set()
    spec.on_step = lambda rec: used.add(rec.scorer) if rec.kind == "decode" else None
    assert [spec.generate([p], params)[0] for p in prompts] == want_alone
    assert spec.generate(prompts, params) == want_batch
    return used


@pytest.mark.parametrize("policy", ["random", "goodput"])
def test_scorer_mix_is_lossless_cpu(policy):
    used = check("cpu", policy, 1)
    if policy == "random":
        assert used == set(SCORERS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["random", "goodput"])
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_scorer_mix_is_lossless_float32(policy, seed):
    used = check("cuda", policy, seed)
    print(f"\nCUDA float32 {policy} seed {seed}: scorers used {sorted(used)}")
    if policy == "random":
        assert used == set(SCORERS)
