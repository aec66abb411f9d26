"""Deterministic mode (``model.deterministic``) at model level: a request's logits do not depend on
its batch, scorer or k, bit for bit, so greedy speculation reproduces non-speculative output exactly.

CPU (in CI): the tiny random model in float32 on the CPU deterministic path (per-row matmul,
per-query attention), with small init (std 0.02: near-tied logits, where a rounding difference would
show). GPU (marked ``gpu``): bf16 on CUDA with the Triton kernels, eager and graph scorers, contexts
up to 4k; and 64 concurrent real prompts on SmolLM2 through the engine.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

from specsched.bench.prompts import GRID_FORMS, GRID_TOPICS
from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.request import Request, SamplingParams
from specsched.kernels.metadata import build_metadata
from specsched.kernels.testing import interpreted_results, run_jobs
from specsched.models.config import get_preset
from specsched.models.llama import LlamaForCausalLM
from specsched.models.random_init import init_random
from specsched.policies.base import BatchView, Plan, Policy
from specsched.proposers.base import Proposals
from specsched.scorers.registry import build_scorers


class RandomPlan(Policy):
    """Test policy: a random k in [0, max_k] per request and a random scorer every step."""

    name = "random_plan"

    def __init__(self, scorers: list[str], seed: int = 0, max_k: int = 8) -> None:
        self.scorers, self.rng, self.max_k = scorers, random.Random(seed), max_k

    def decide(self, view: BatchView, costs) -> Plan:
        k = [self.rng.randint(0, min(self.max_k, r.max_k)) for r in view.requests]
        return Plan(k, self.rng.choice(self.scorers), self.name)


def prefill(model, kv, tokens: list[int], table: list[int], block: int, chunks: list[int]) -> None:
    """Prefill ``tokens`` into ``kv`` in chunks of the given sizes (the rest in the last)."""
    dev = model.lm_head.weight.device
    done = 0
    with torch.inference_mode():
        for size in [*chunks, len(tokens)]:
            end = min(done + size, len(tokens))
            if end <= done:
                continue
            meta = build_metadata([end - done], [end], [table], block, dev)
            model(torch.tensor(tokens[done:end], device=dev), torch.arange(done, end, device=dev), meta, kv)
            done = end


def decode_alone(model, kv, tokens: list[int], start: int, table: list[int], block: int) -> torch.Tensor:
    """The non-speculative path: tokens[start:] one decode step each (one row, q_len 1), after a
    prefix already in ``kv``; the logits of every step [len(tokens) - start, vocab]."""
    dev = model.lm_head.weight.device
    out = []
    with torch.inference_mode():
        for p in range(start, len(tokens)):
            meta = build_metadata([1], [p + 1], [table], block, dev)
            out.append(model(torch.tensor([tokens[p]], device=dev), torch.tensor([p], device=dev), meta, kv))
    return torch.cat(out)


def make_batch(model, kv, rng: random.Random, num: int, max_ctx: int, block: int, max_chunk: int = 64):
    """Requests with prompts prefilled (all but the last token, in random chunks) and ragged drafts
    (k = 0..8); blocks drawn at random, block 0 left as the pad block."""
    vocab = model.cfg.vocab_size
    free = list(range(1, kv[0][0].shape[0]))
    rng.shuffle(free)
    reqs, drafts = [], []
    for i in range(num):
        n = rng.randint(1, max_ctx)
        k = [0, 8, rng.randint(0, 8)][i % 3]
        prompt = [rng.randrange(vocab) for _ in range(n)]
        table = [free.pop() for _ in range(-(-(n + k) // block))]
        chunk = rng.randint(max(1, max_chunk // 16), max_chunk)
        prefill(model, kv, prompt[:-1], table, block, [chunk] * (n // chunk + 1))
        r = Request(f"r{i}", prompt, SamplingParams(), block_table=table)
        r.num_computed = n - 1
        reqs.append(r)
        drafts.append([rng.randrange(vocab) for _ in range(k)])
    return reqs, drafts


def alone_logits(model, kv, reqs, drafts, block: int) -> torch.Tensor:  # [sum(k_i + 1), vocab]
    rows = []
    for r, d in zip(reqs, drafts):
        rows.append(decode_alone(model, kv, r.prompt_ids + d, r.num_computed, r.block_table, block))
    return torch.cat(rows)


def unequal_requests(got: torch.Tensor, want: torch.Tensor, drafts: list[list[int]]) -> list[int]:
    """Indices of the requests whose rows are not bitwise equal."""
    bad, i = [], 0
    for j, d in enumerate(drafts):
        if not torch.equal(got[i : i + len(d) + 1], want[i : i + len(d) + 1]):
            bad.append(j)
        i += len(d) + 1
    return bad


def draft_kv_mismatches(model, kv, reqs, drafts, scorer, block: int) -> list[tuple[str, int, int]]:
    """(request, position, layer) whose K or V, as ``scorer`` wrote it for the step's input token and
    drafts, is not bitwise what decoding the same tokens one at a time writes there. Logits can hide
    such a difference (the test above compares logits only): a later step reads this KV."""
    props = Proposals.from_lists(drafts, str(model.lm_head.weight.device))
    scorer.score(reqs, props)
    written = [(k.clone(), v.clone()) for k, v in kv]
    for r, d in zip(reqs, drafts):
        decode_alone(model, kv, r.prompt_ids + d, r.num_computed, r.block_table, block)
    bad = []
    for r, d in zip(reqs, drafts):
        for p in range(r.num_computed, r.num_computed + len(d) + 1):
            b, o = r.block_table[p // block], p % block
            for layer, ((k0, v0), (k1, v1)) in enumerate(zip(written, kv)):
                if not (torch.equal(k0[b, o], k1[b, o]) and torch.equal(v0[b, o], v1[b, o])):
                    bad.append((r.request_id, p, layer))
                    break
    return bad


# --- CPU -------------------------------------------------------------------------------------------

BLOCK = 4


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    model = LlamaForCausalLM(get_preset("tiny"), deterministic=True).eval()
    return init_random(model, seed=3, std=0.02)


@pytest.mark.parametrize("seed", [0, 1])
def test_logits_alone_equal_logits_in_mixed_batch(tiny, seed: int) -> None:
    rng = random.Random(seed)
    kv = tiny.allocate_kv_cache(300, BLOCK)
    reqs, drafts = make_batch(tiny, kv, rng, num=7, max_ctx=60, block=BLOCK, max_chunk=16)
    props = Proposals.from_lists(drafts)
    scorers = build_scorers(["batch_expansion", "mqa"], tiny, kv, BLOCK)
    got = {name: s.score(reqs, props).clone() for name, s in scorers.items()}
    want = alone_logits(tiny, kv, reqs, drafts, BLOCK)
    for name, logits in got.items():
        assert unequal_requests(logits, want, drafts) == [], name


def triton_path_job() -> dict:
    """Subprocess side (TRITON_INTERPRET=1): the same check through the Triton kernels (attention
    backend triton, the Triton matmul), a smaller batch (the interpreter is slow)."""
    model = LlamaForCausalLM(get_preset("tiny"), "triton", deterministic=True).eval()
    init_random(model, seed=3, std=0.02)
    kv = model.allocate_kv_cache(100, BLOCK)
    reqs, drafts = make_batch(model, kv, random.Random(0), num=3, max_ctx=20, block=BLOCK, max_chunk=8)
    props = Proposals.from_lists(drafts)
    got = {n: s.score(reqs, props).clone() for n, s in
           build_scorers(["batch_expansion", "mqa"], model, kv, BLOCK).items()}  # fmt: skip
    want = alone_logits(model, kv, reqs, drafts, BLOCK)
    return {"unequal": {n: unequal_requests(g, want, drafts) for n, g in got.items()},
            "ks": [len(d) for d in drafts]}  # fmt: skip


def test_interpreted_triton_path_logits_alone_equal_in_mixed_batch() -> None:
    r = interpreted_results(__file__, timeout_s=600)["triton_path"]
    assert "error" not in r, r.get("error")
    assert r["unequal"] == {"batch_expansion": [], "mqa": []}, r
    assert max(r["ks"]) == 8, r


@pytest.mark.parametrize("name", ["batch_expansion", "mqa"])
def test_draft_kv_equals_decode_kv(tiny, name: str) -> None:
    block = BLOCK
    kv = tiny.allocate_kv_cache(8 * (48 // block + 3) + 2, block)
    reqs, drafts = make_batch(tiny, kv, random.Random(4), num=8, max_ctx=48, block=block, max_chunk=16)
    scorer = build_scorers([name], tiny, kv, block)[name]
    assert draft_kv_mismatches(tiny, kv, reqs, drafts, scorer, block) == []


def test_deterministic_mode_switches_every_linear_and_attention(tiny) -> None:
    from specsched.kernels.batch_invariant_attention import paged_attention_per_query
    from specsched.models.llama import Linear

    linears = [m for m in tiny.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * tiny.cfg.num_layers + 1 and all(m.deterministic for m in linears)
    assert tiny.attn is paged_attention_per_query
    with pytest.raises(ValueError, match="keeps attention backend"):
        tiny.set_attn_backend("triton")


def make_engine(proposer: str, scorer_names: list[str], seed: int, **model_kw) -> Engine:
    cfg = EngineConfig(
        model=ModelConfig(**{"source": "tiny", "device": "cpu", "dtype": "float32", **model_kw}),
        cache=CacheConfig(block_size=BLOCK, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
        spec=SpecConfig(proposer=proposer, scorers=scorer_names, max_k=8),
        policy={"name": "fixed", "k": 0, "scorer": scorer_names[0]},
    )
    engine = Engine(cfg)
    engine.policy = RandomPlan(scorer_names, seed)
    return engine


def test_engine_greedy_spec_equals_non_spec(monkeypatch) -> None:
    """Through the config: model.deterministic reaches the model; both scorers, random k."""
    import specsched.models.loader as loader

    monkeypatch.setitem(loader.PRESET_INIT_STD, "tiny", 0.02)  # near-tied logits
    names = ["batch_expansion", "mqa"]
    base = make_engine("none", names, 0, deterministic=True)
    spec = make_engine("ngram", names, 1, deterministic=True)
    assert base.model.deterministic and spec.model.deterministic
    rng = random.Random(7)
    proposed = 0
    for _ in range(2):
        prompts = []
        for _ in range(6):
            motif = [rng.randrange(3, 256) for _ in range(rng.randint(2, 5))]
            prompts.append((motif * 20)[: rng.randint(2, 40)])
        params = [SamplingParams(max_tokens=rng.randint(4, 16), ignore_eos=True) for _ in prompts]
        want = base.generate(prompts, params)
        reqs = [Request(f"q{i}-{len(p)}", p, SamplingParams(**vars(sp))) for i, (p, sp) in
                enumerate(zip(prompts, params))]  # fmt: skip
        for r in reqs:
            spec.add_request(r)
        while spec.has_unfinished:
            spec.step()
        assert [r.output_ids for r in reqs] == want
        proposed += sum(r.num_proposed for r in reqs)
    assert proposed > 0, "the test must actually speculate"


# --- GPU -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_model() -> LlamaForCausalLM:
    """SmolLM2-135M's shape (GQA group 3, head_dim 64), random bf16 weights (std 0.02: near ties),
    loaded as the engine loads it with ``model.deterministic=true``."""
    from specsched.models.loader import load_model

    cfg = ModelConfig(source="smollm2-135m", dtype="bfloat16", device="cuda", deterministic=True)
    model = load_model(cfg, progress=False).model
    assert model.deterministic and model.attn_backend == "triton"
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_logits_bitwise_invariant_bf16(gpu_model, seed: int) -> None:
    """Random batches (24 requests, k = 0..8, contexts 1..4096, prefilled in random chunks): every
    request's logits from eager batch expansion, eager MQA, graph batch expansion and graph MQA are
    bitwise equal to the request decoded alone, one token per step."""
    from specsched.scorers.graph import GraphConfig, build_graph_scorers

    block, max_ctx = 16, 4096
    rng = random.Random(seed)
    kv = gpu_model.allocate_kv_cache(24 * (max_ctx // block + 2) + 8, block)
    reqs, drafts = make_batch(gpu_model, kv, rng, num=24, max_ctx=max_ctx, block=block, max_chunk=2048)
    props = Proposals.from_lists(drafts, "cuda")
    got = {name: s.score(reqs, props).clone() for name, s in
           build_scorers(["batch_expansion", "mqa"], gpu_model, kv, block).items()}  # fmt: skip
    graphs = GraphConfig(max_batch=32, max_k=8, max_model_len=max_ctx + 16, progress=False)
    graph_scorers = build_graph_scorers(["batch_expansion", "mqa_graph"], gpu_model, kv, block, graphs)
    for name, s in graph_scorers.items():
        got[f"{name}(graph)"] = s.score(reqs, props).clone()
        assert s.runner.num_eager_fallbacks == 0, s.runner.fallback_reasons
    want = alone_logits(gpu_model, kv, reqs, drafts, block)
    bad = {name: unequal_requests(logits, want, drafts) for name, logits in got.items()}
    assert bad == {name: [] for name in got}, bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefill_chunking_writes_the_same_kv(gpu_model) -> None:
    """A prompt's KV is bitwise the same prefilled in one chunk alone or in chunks beside others."""
    block, n = 16, 3000
    rng = random.Random(5)
    prompt = [rng.randrange(gpu_model.cfg.vocab_size) for _ in range(n)]
    table = list(range(1, -(-n // block) + 1))
    kv_a = gpu_model.allocate_kv_cache(len(table) + 1, block)
    kv_b = gpu_model.allocate_kv_cache(len(table) + 1, block)
    prefill(gpu_model, kv_a, prompt, table, block, [n])
    prefill(gpu_model, kv_b, prompt, table, block, [700, 1, 1100, 37])
    for (ka, va), (kb, vb) in zip(kv_a, kv_b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["batch_expansion", "mqa", "batch_expansion(graph)", "mqa_graph"])
def test_gpu_draft_kv_bitwise_equals_decode_kv(gpu_model, name: str) -> None:
    """The KV each scorer writes for a step's input token and drafts is bitwise the KV the same
    tokens get decoded one at a time (a later step reads it). Written after the H200 on 2026-12-04:
    SmolLM2 prompt 24, fixed k = 8 on MQA, diverges at the step after one that accepted 2 of 8 drafts
    (test_gpu_smollm2_one_prompt_fixed_k8_mqa_equals_non_spec)."""
    from specsched.scorers.graph import GraphConfig, build_graph_scorers

    block, max_ctx = 16, 1024
    kv = gpu_model.allocate_kv_cache(16 * (max_ctx // block + 2) + 8, block)
    reqs, drafts = make_batch(
        gpu_model, kv, random.Random(11), num=16, max_ctx=max_ctx, block=block, max_chunk=512
    )
    if name.endswith("(graph)") or name == "mqa_graph":
        base = "batch_expansion" if name.startswith("batch") else "mqa_graph"
        graphs = GraphConfig(max_batch=16, max_k=8, max_model_len=max_ctx + 16, progress=False)
        scorer = build_graph_scorers([base], gpu_model, kv, block, graphs)[base]
    else:
        scorer = build_scorers([name], gpu_model, kv, block)[name]
    assert draft_kv_mismatches(gpu_model, kv, reqs, drafts, scorer, block) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sampling_probs_are_row_invariant() -> None:
    """logits_to_probs (temperature, top-k, top-p, softmax) is computed per row: a row's probabilities
    do not depend on how many other rows are in the batch."""
    from specsched.kernels.sampling import SamplingTensors, logits_to_probs

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(300, 49152, device="cuda", generator=gen) * 4
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=50)
    full = logits_to_probs(logits, SamplingTensors.from_params([sp] * 300, device="cuda"))
    for rows in (1, 7, 64):
        part = logits_to_probs(logits[:rows], SamplingTensors.from_params([sp] * rows, device="cuda"))
        assert torch.equal(part, full[:rows]), rows


PROMPT_TOPICS, PROMPT_FORMS = GRID_TOPICS, GRID_FORMS  # bench/prompts.py


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_gpu_smollm2_64_prompts_spec_equals_non_spec(smollm2_path, smollm2_cache_dir, deterministic) -> None:
    """64 concurrent chat prompts, greedy, bf16, graphs on: the speculative outputs (n-gram, random k
    and a random scorer among all three every step) against the non-speculative ones. Deterministic:
    100 % equal; default: the share is printed (the issue measured 37-40 of 48)."""
    del smollm2_path

    def engine(proposer: str, seed: int) -> Engine:
        names = ["batch_expansion", "mqa", "mqa_graph"]
        cfg = EngineConfig(
            model=ModelConfig(source="smollm2", dtype="bfloat16", device="cuda", deterministic=deterministic,
                              cache_dir=str(smollm2_cache_dir), max_model_len=2048, kernel_warmup="off"),
            cache=CacheConfig(block_size=16, num_blocks=8192),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
            spec=SpecConfig(proposer=proposer, scorers=names, max_k=8),
            policy={"name": "fixed", "k": 0, "scorer": "batch_expansion"},
        )  # fmt: skip
        e = Engine(cfg)
        e.policy = RandomPlan(names, seed)
        return e

    base = engine("none", 0)
    prompts = [base.tokenizer.apply_chat_template([{"role": "user", "content": f.format(t)}])
               for f in PROMPT_FORMS for t in PROMPT_TOPICS]  # fmt: skip
    assert len(prompts) == 64
    params = SamplingParams(max_tokens=128)
    want = base.generate(prompts, params)
    del base
    torch.cuda.empty_cache()
    got = engine("ngram", 1).generate(prompts, params)
    same = sum(a == b for a, b in zip(got, want))
    print(f"\nSmolLM2 bf16, deterministic={deterministic}: {same}/64 spec outputs == non-spec")
    if deterministic:
        assert same == 64


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_model_len", [None, 2048], ids=["model_len", "len2048"])
def test_gpu_smollm2_daemon_config_spec_equals_non_spec(smollm2_path, smollm2_cache_dir, max_model_len):
    """The serving daemons' configs (H200, 2026-12-03: 85-90 % same output through the daemon, 64/64 in
    the test above): the baseline built as bench=serve builds it (fixed k = 0 on batch expansion, that
    scorer only), the speculative engine with goodput over the default scorers, kernel warm-up on,
    the model's own context length or 2048; 12 prompts one at a time (N = 1) and all 64 at once."""
    del smollm2_path

    def engine(proposer: str, scorers: list[str], policy: dict) -> Engine:
        cfg = EngineConfig(
            model=ModelConfig(source="smollm2", dtype="bfloat16", device="cuda", deterministic=True,
                              cache_dir=str(smollm2_cache_dir), max_model_len=max_model_len),
            cache=CacheConfig(block_size=16, num_blocks=8192),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
            spec=SpecConfig(proposer=proposer, scorers=scorers, max_k=8),
            policy=policy,
        )  # fmt: skip
        return Engine(cfg)

    def outputs(e: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
        params = SamplingParams(max_tokens=128)
        return [e.generate([p], params)[0] for p in prompts[:12]], e.generate(prompts, params)

    base = engine("none", ["batch_expansion"], {"name": "fixed", "k": 0, "scorer": "batch_expansion"})
    prompts = [base.tokenizer.apply_chat_template([{"role": "user", "content": f.format(t)}])
               for f in PROMPT_FORMS for t in PROMPT_TOPICS]  # fmt: skip
    want_1, want_64 = outputs(base, prompts)
    del base
    torch.cuda.empty_cache()
    spec = engine("ngram", ["batch_expansion", "mqa", "mqa_graph"], {"name": "goodput"})
    scorers: set[str] = set()
    spec.on_step = lambda rec: scorers.add(rec.scorer) if rec.kind == "decode" else None
    got_1, got_64 = outputs(spec, prompts)
    same_1 = sum(a == b for a, b in zip(got_1, want_1))
    same_64 = sum(a == b for a, b in zip(got_64, want_64))
    print(f"\nSmolLM2 bf16 deterministic, daemon config, max_model_len={max_model_len}: "
          f"N=1 {same_1}/12, N=64 {same_64}/64 spec == non-spec {sorted(scorers)}")  # fmt: skip
    assert (same_1, same_64) == (12, 64)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scorer", ["mqa_graph", "mqa"])
def test_gpu_smollm2_one_prompt_fixed_k8_mqa_equals_non_spec(smollm2_path, smollm2_cache_dir, scorer) -> None:
    """Deterministic mode's smallest known failure until a7dbb5b (H200, 2026-12-04): prompt 24 of the 64
    alone, n-gram with fixed k = 8 on either MQA scorer, max_model_len 2048, emitted token 253 at output
    50 where the non-speculative run emits 198. Its logits first differed at output 29, the 7th query
    of an MQA step whose 4-query tile straddled a multiple of 64 keys: the attention kernel's unmasked
    key tiles compiled to other arithmetic (an FMA) than the masked ones, and which tiles a query took
    unmasked depended on its query tile's start. Passed on the H200 after the fix (both scorers); the
    kernel-level form is tests/kernels/test_batch_invariant.py's straddling test."""
    del smollm2_path

    def engine(proposer: str, policy: dict) -> Engine:
        cfg = EngineConfig(
            model=ModelConfig(source="smollm2", dtype="bfloat16", device="cuda", deterministic=True,
                              cache_dir=str(smollm2_cache_dir), max_model_len=2048),
            cache=CacheConfig(block_size=16, num_blocks=2048),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
            spec=SpecConfig(proposer=proposer, scorers=["batch_expansion", "mqa", "mqa_graph"], max_k=8),
            policy=policy,
        )  # fmt: skip
        return Engine(cfg)

    base = engine("none", {"name": "fixed", "k": 0, "scorer": "batch_expansion"})
    prompts = [base.tokenizer.apply_chat_template([{"role": "user", "content": f.format(t)}])
               for f in PROMPT_FORMS for t in PROMPT_TOPICS]  # fmt: skip
    params = SamplingParams(max_tokens=64)
    want = base.generate([prompts[24]], params)[0]
    del base
    torch.cuda.empty_cache()
    got = engine("ngram", {"name": "fixed", "k": 8, "scorer": scorer}).generate([prompts[24]], params)[0]
    assert got == want


if __name__ == "__main__" and sys.argv[1:] == ["--interpreted"]:
    run_jobs({"triton_path": triton_path_job})
