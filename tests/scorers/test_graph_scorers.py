"""Graph runner and graph scorers: padded replays equal the eager forward, misses fall back eagerly
(counted), and speculative greedy == non-speculative greedy with graphs on.

CPU: the runner in ``emulate`` mode (replay re-runs the forward on the padded static buffers), which
checks bucketing, padding and the buffers. GPU (marked ``gpu``): real CUDA graphs with the Triton
backend — bf16 logits against the eager MQA scorer, and the greedy engine equality in float32.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from specsched.engine.components import EngineParts
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
from specsched.kernels.metadata import build_metadata
from specsched.models.config import get_preset
from specsched.models.cuda_graphs import GraphRunner
from specsched.models.graph_buckets import GraphBucket, decode_buckets, mqa_buckets, size_ladder
from specsched.models.llama import LlamaForCausalLM, rope_inv_freq
from specsched.models.loader import load_model
from specsched.models.random_init import init_random
from specsched.policies.acceptance import AcceptanceEstimator
from specsched.policies.base import BatchView, Plan, Policy
from specsched.policies.cost_model import CostModels
from specsched.proposers.base import Proposals
from specsched.proposers.registry import build_proposers
from specsched.scorers.graph import (
    GraphBatchExpansionScorer,
    GraphConfig,
    GraphForward,
    MQAGraphScorer,
    attach_draft_graphs,
    graph_buckets_of,
)
from specsched.scorers.mqa import MQAScorer
from specsched.scorers.registry import build_scorers

BLOCK = 4
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def tiny_model(device: str = "cpu", dtype: torch.dtype = torch.float32, preset: str = "tiny"):
    std = 0.1 if preset == "tiny" else 0.02
    m = init_random(LlamaForCausalLM(get_preset(preset)).eval(), seed=0, std=std)
    m = m.to(device=device, dtype=dtype).requires_grad_(False)
    m.inv_freq = rope_inv_freq(m.cfg).to(device)  # .to(dtype) cast the rotary buffer too
    return m


def clone_kv(kv):
    return [(k.clone(), v.clone()) for k, v in kv]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- buckets -------------------------------------------------------------------------------------
def test_size_ladder_and_buckets():
    assert size_ladder(512) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert size_ladder(100)[-2:] == [96, 100] and size_ladder(1) == [1]
    assert all(b.rows == b.tokens and b.max_q == 1 for b in decode_buckets(64))
    mqa = mqa_buckets(4, 4)
    assert {(b.rows, b.tokens) for b in mqa} == {(1, 2), (1, 4), (2, 4), (2, 8), (4, 8), (4, 16)}
    assert all(b.tokens <= b.rows * b.max_q and b.max_q <= 4 for b in mqa)
    with pytest.raises(ValueError, match="can never be filled"):
        GraphBucket(2, 9, 4)
    with pytest.raises(ValueError, match="max_q >= 2"):
        mqa_buckets(4, 1)


def test_runner_needs_cuda_unless_emulated():
    m = tiny_model()
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
        GraphRunner(m, m.allocate_kv_cache(8, BLOCK), [(1, 1)], 4, progress=False)


# ---- runner: padded replay == eager ---------------------------------------------------------------
@pytest.mark.parametrize("is_expanded", [False, True], ids=["mqa", "expanded"])
@pytest.mark.parametrize("seed", range(3))
def test_emulated_runner_equals_eager_forward(seed, is_expanded, decoding_batch):
    from specsched.scorers.inputs import build_scoring_inputs

    rng = random.Random(seed)
    model = tiny_model()
    kv = model.allocate_kv_cache(200, BLOCK)
    reqs, props = decoding_batch(model, kv, rng, rng.randint(1, 4))
    runner = GraphRunner(model, kv, decode_buckets(24) + mqa_buckets(4, 6), 16, emulate=True, progress=False)
    x = build_scoring_inputs(reqs, props, BLOCK, torch.device("cpu"), is_expanded=is_expanded)
    ref_kv = clone_kv(kv)
    with torch.inference_mode():
        want = model(x.input_ids, x.positions, x.meta, ref_kv)
    got = runner.run(x.input_ids, x.positions, x.meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert runner.num_replays == 1 and runner.num_eager_fallbacks == 0
    # the real K/V landed in the real slots; only block 0 (padding) differs
    for (k, v), (rk, rv) in zip(kv, ref_kv, strict=True):
        torch.testing.assert_close(k[1:], rk[1:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[1:], rv[1:], atol=1e-5, rtol=1e-5)


def test_shapes_outside_the_buckets_run_eagerly_and_are_counted(caplog, decoding_batch):
    rng = random.Random(7)
    model = tiny_model()
    kv = model.allocate_kv_cache(300, BLOCK)
    reqs, props = decoding_batch(model, kv, rng, 6, max_k=5, max_len=60)
    runner = GraphRunner(model, kv, decode_buckets(4) + mqa_buckets(2, 3), 8, emulate=True, progress=False)
    scorer = MQAGraphScorer(runner, BLOCK)
    eager = MQAScorer(model, clone_kv(kv), BLOCK)
    with caplog.at_level(logging.WARNING, logger="specsched.models.cuda_graphs"):
        got = scorer.score(reqs, props)  # 6 rows > 2, context up to 65 > 8 blocks
        scorer.score(reqs, props)
    torch.testing.assert_close(got, eager.score(reqs, props), atol=1e-5, rtol=1e-5)
    assert runner.num_eager_fallbacks == 2 and runner.num_replays == 0
    assert sum(runner.fallback_reasons.values()) == 2 and len(runner.fallback_reasons) == 1
    assert len([r for r in caplog.records if "running eagerly" in r.message]) == 1  # logged once per reason
    assert runner.find_bucket(3, 3, 1)[0] == GraphBucket(4, 4, 1)
    assert runner.find_bucket(5, 5, 1)[1] == "rows above largest bucket"
    assert runner.find_bucket(2, 3, 3)[0] == GraphBucket(2, 4, 3)
    assert runner.find_bucket(1, 4, 4)[1] == "max_q above captured"
    assert runner.find_bucket(1, 1, 1, width=9)[1] == "context above captured"


# ---- scorers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_emulated_graph_scorers_equal_eager_mqa(seed, decoding_batch):
    rng = random.Random(100 + seed)
    model = tiny_model()
    kv = model.allocate_kv_cache(300, BLOCK)
    reqs, props = decoding_batch(model, kv, rng, rng.randint(1, 7))
    cfg = GraphConfig(max_batch=8, max_k=5, max_model_len=64, emulate=True, progress=False)
    scorers = build_scorers(["batch_expansion", "mqa", "mqa_graph"], model, kv, BLOCK, cfg)
    assert isinstance(scorers["batch_expansion"], GraphBatchExpansionScorer)
    assert isinstance(scorers["mqa_graph"], MQAGraphScorer) and isinstance(scorers["mqa"], MQAScorer)
    assert scorers["batch_expansion"].runner is scorers["mqa_graph"].runner
    want = MQAScorer(model, clone_kv(kv), BLOCK).score(reqs, props)
    for name in ("batch_expansion", "mqa_graph"):
        torch.testing.assert_close(scorers[name].score(reqs, props), want, atol=1e-5, rtol=1e-5)
    runner = scorers["mqa_graph"].runner
    assert runner.num_replays == 2 and runner.num_eager_fallbacks == 0
    buckets = graph_buckets_of(scorers)
    assert set(buckets) == {"batch_expansion", "mqa_graph"} and buckets["batch_expansion"][-1] == 8 * 6


def test_without_cuda_graph_scorers_are_eager_with_one_warning(caplog):
    model = tiny_model()
    kv = model.allocate_kv_cache(16, BLOCK)
    with caplog.at_level(logging.WARNING, logger="specsched.scorers.registry"):
        scorers = build_scorers(["batch_expansion", "mqa_graph"], model, kv, BLOCK, GraphConfig())
    assert type(scorers["mqa_graph"]) is MQAScorer
    assert not isinstance(scorers["batch_expansion"], GraphBatchExpansionScorer)
    warnings = [r for r in caplog.records if "mqa_graph" in r.message]
    assert len(warnings) == 1 and "cpu" in warnings[0].message
    with pytest.raises(ValueError, match="unknown scorer 'mqa_grph'; known: batch_expansion, mqa, mqa_graph"):
        build_scorers(["mqa_grph"], model, kv, BLOCK, None)


def test_graph_forward_replays_decode_steps_only():
    rng = random.Random(5)
    model = tiny_model()
    kv = model.allocate_kv_cache(100, BLOCK, num_layers=2)
    fwd = GraphForward(GraphRunner(model, kv, decode_buckets(8), 16, 2, emulate=True, progress=False))
    tables = [[rng.randrange(1, 100) for _ in range(4)] for _ in range(3)]
    for q_lens in ([1, 1, 1], [3, 1, 2]):
        k_lens = [q + 5 for q in q_lens]
        meta = build_metadata(q_lens, k_lens, tables, BLOCK)
        ids = torch.randint(0, 256, (sum(q_lens),))
        pos = torch.tensor([p for q, k in zip(q_lens, k_lens, strict=True) for p in range(k - q, k)])
        last = torch.tensor(q_lens).cumsum(0) - 1
        ref_kv = clone_kv(kv)
        with torch.inference_mode():
            want = model(ids, pos, meta, ref_kv, last, num_layers=2)
            got = fwd(ids, pos, meta, kv, last, num_layers=2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert fwd.runner.num_replays == 1 and fwd.num_eager_calls == 1
    with pytest.raises(ValueError, match="captured over another KV cache"):
        fwd(ids, pos, meta, clone_kv(kv), last, num_layers=2)


# ---- engine: greedy speculative == greedy non-speculative with graphs on ---------------------------------
class RandomK(Policy):
    name = "random_k"

    def __init__(self, scorer: str, seed: int) -> None:
        self.scorer, self.rng = scorer, random.Random(seed)

    def decide(self, view: BatchView, costs) -> Plan:
        return Plan([self.rng.randint(0, min(4, r.max_k)) for r in view.requests], self.scorer, self.name)


def graph_engine(
    device: str, scorer: str, proposer: str, graphs: bool, seed: int = 0, piecewise: bool = False,
    draft_loop: bool = False,
) -> tuple[Engine, GraphForward | None]:  # fmt: skip
    """An engine over the tiny preset with graph scorers (emulated on CPU) and, when the draft
    proposer has the ``graph_forward`` hook, graph-replayed draft steps (returned); ``draft_loop``:
    its steps 2..k in one replay of the draft loop graphs (models/draft_loop.py)."""
    loaded = load_model(ModelConfig(source="tiny", device=device, dtype="float32"), progress=False)
    model, num_blocks, max_len = loaded.model, 400, 256
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device=device, dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        spec=SpecConfig(proposer=proposer, scorers=["batch_expansion", "mqa", "mqa_graph"], max_k=4,
                        draft=DraftConfig(source="self", num_layers=2)),
    )  # fmt: skip
    kv = model.allocate_kv_cache(num_blocks, BLOCK)
    gcfg = GraphConfig.for_engine(
        cfg, max_len, enabled=graphs, emulate=device == "cpu", progress=False, piecewise=piecewise,
        draft_loop=draft_loop,
    )  # fmt: skip
    scorers = build_scorers(cfg.spec.scorers, model, kv, BLOCK, gcfg)
    proposers = build_proposers(cfg.spec, model, num_blocks, BLOCK)
    draft_fwd = None
    if graphs and "draft" in proposers:
        draft_fwd = attach_draft_graphs(proposers["draft"], gcfg, BLOCK)
    parts = EngineParts(
        model=model, tokenizer=None, kv_cache=kv, num_blocks=num_blocks, proposers=proposers, scorers=scorers,
        policy=RandomK(scorer, seed), costs=CostModels(graph_buckets_of(scorers)),
        acceptance=AcceptanceEstimator(), model_name="tiny", device=model.lm_head.weight.device,
        max_model_len=max_len, eos_token_ids=[2],
    )  # fmt: skip
    return Engine(cfg, parts), draft_fwd


def random_prompts(rng: random.Random, n: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 256) for _ in range(rng.randint(2, 6))]
        out.append((motif * 20)[: rng.randint(2, 60)])
    return out


def check_greedy_equality(
    device: str, scorer: str, proposer: str, piecewise: bool = False, draft_loop: bool = False
) -> Engine:
    rng = random.Random(sum(map(ord, device + scorer + proposer)))
    base, _ = graph_engine(device, "mqa", "none", graphs=False)
    spec, draft_fwd = graph_engine(
        device, scorer, proposer, graphs=True, seed=rng.randrange(100), piecewise=piecewise,
        draft_loop=draft_loop,
    )  # fmt: skip
    prompts = random_prompts(rng, 5)
    params = [SamplingParams(max_tokens=rng.randint(1, 14), ignore_eos=True) for _ in prompts]
    assert spec.generate(prompts, params) == base.generate(prompts, params)
    if draft_fwd is not None:  # the draft proposer has the hook: its single-token steps replayed graphs
        assert draft_fwd.runner.num_replays > 0 and draft_fwd.runner.num_eager_fallbacks == 0
    return spec


@pytest.mark.parametrize("scorer", ["batch_expansion", "mqa_graph"])
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_emulated_graphs_greedy_equals_non_speculative(scorer, proposer):
    engine = check_greedy_equality("cpu", scorer, proposer)
    runner = engine.scorers[scorer].runner
    assert runner.num_replays > 0 and runner.num_eager_fallbacks == 0


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_emulated_piecewise_mqa_greedy_equals_non_speculative(proposer):
    """The eager MQA scorer on (emulated) piecewise graphs: random k per request every step."""
    engine = check_greedy_equality("cpu", "mqa", proposer, piecewise=True)
    runner = engine.scorers["mqa"].piecewise
    assert runner is not None and runner.num_replays > 0 and runner.num_eager_fallbacks == 0


@pytest.mark.parametrize("scorer", ["batch_expansion", "mqa_graph", "mqa"])
def test_emulated_draft_loop_greedy_equals_non_speculative(scorer):
    """The self-draft's steps 2..k in one (emulated) replay of the draft loop graphs per propose, k
    random per request every step (0 and 1 among them): the output is still the target's."""
    engine = check_greedy_equality("cpu", scorer, "draft", draft_loop=True)
    loop = engine.proposers["draft"].loop_graphs
    assert loop is not None and loop.num_replays > 0 and loop.num_misses == 0


# ---- GPU -----------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@no_cuda
@pytest.mark.parametrize("seed", range(2))
def test_cuda_graph_scorers_vs_eager_mqa_bf16(seed, decoding_batch):
    rng = random.Random(200 + seed)
    model = tiny_model("cuda", torch.bfloat16, preset="llama-68m")
    model.set_attn_backend("triton")
    kv = model.allocate_kv_cache(3000, BLOCK)
    reqs, props = decoding_batch(model, kv, rng, 12, max_k=5, max_len=700)
    cfg = GraphConfig(max_batch=16, max_k=5, max_model_len=1024, progress=False)
    scorers = build_scorers(["batch_expansion", "mqa", "mqa_graph"], model, kv, BLOCK, cfg)
    want = MQAScorer(model, clone_kv(kv), BLOCK).score(reqs, props)
    for name in ("batch_expansion", "mqa_graph"):
        got = scorers[name].score(reqs, props)
        err = rel_err(got, want)
        print(f"GPU bf16 {name} (graph) vs eager mqa: rel. error {err:.2e} over {tuple(want.shape)}")
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert err < 1e-2, f"{name}: rel. error {err}"
    runner = scorers["mqa_graph"].runner
    print("GPU runner:", runner.stats())
    assert runner.num_replays == 2 and runner.num_eager_fallbacks == 0


@gpu
@no_cuda
def test_cuda_graph_fallback_outside_buckets_equals_eager(decoding_batch):
    rng = random.Random(3)
    model = tiny_model("cuda", torch.float32)
    model.set_attn_backend("triton")
    kv = model.allocate_kv_cache(400, BLOCK)
    reqs, props = decoding_batch(model, kv, rng, 6, max_k=5, max_len=60)
    runner = GraphRunner(model, kv, decode_buckets(4) + mqa_buckets(2, 3), 32, progress=False)
    want = MQAScorer(model, clone_kv(kv), BLOCK).score(reqs, props)
    got_eager = MQAGraphScorer(runner, BLOCK).score(reqs, props)  # 6 rows > 2: eager
    flat, cu = props.draft_tokens.tolist(), props.cu_num_draft.tolist()
    small = Proposals.from_lists([flat[cu[i] : cu[i + 1]][:2] for i in range(2)], "cuda")  # 2 rows, q <= 3
    got_graph = MQAGraphScorer(runner, BLOCK).score(reqs[:2], small)
    want_small = MQAScorer(model, clone_kv(kv), BLOCK).score(reqs[:2], small)
    torch.testing.assert_close(got_eager, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_graph, want_small, atol=1e-4, rtol=1e-4)
    assert runner.num_eager_fallbacks == 1 and runner.num_replays == 1


@gpu
@no_cuda
@pytest.mark.parametrize("scorer", ["batch_expansion", "mqa_graph"])
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_cuda_graphs_greedy_equals_non_speculative(scorer, proposer):
    engine = check_greedy_equality("cuda", scorer, proposer)
    runner = engine.scorers[scorer].runner
    print(f"GPU engine {scorer}/{proposer}:", runner.stats())
    assert runner.num_replays > 0 and runner.num_eager_fallbacks == 0


@gpu
@no_cuda
@pytest.mark.parametrize("scorer", ["batch_expansion", "mqa_graph"])
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_cuda_graphs_with_pdl_greedy_equals_non_speculative(scorer, proposer):
    """model.pdl's launches (kernels/pdl.py) in every graph and eager forward: still lossless."""
    from specsched.kernels.pdl import pdl_enabled

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    with pdl_enabled(True):
        engine = check_greedy_equality("cuda", scorer, proposer)
    assert engine.scorers[scorer].runner.num_replays > 0


@gpu
@no_cuda
@pytest.mark.parametrize("scorer", ["batch_expansion", "mqa_graph"])
def test_cuda_draft_loop_greedy_equals_non_speculative(scorer):
    """``draft.loop_graphs`` on real CUDA graphs: lossless, every looped propose in one replay."""
    engine = check_greedy_equality("cuda", scorer, "draft", draft_loop=True)
    loop = engine.proposers["draft"].loop_graphs
    print(f"GPU draft loop {scorer}:", loop.stats())
    assert loop.num_replays > 0 and loop.num_misses == 0


@gpu
@no_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_piecewise_mqa_vs_eager_mqa(dtype, decoding_batch):
    """Real piecewise graphs on the GPU against the eager MQA scorer, ragged k, two batches."""
    rng = random.Random(300)
    model = tiny_model("cuda", dtype, preset="llama-68m")
    model.set_attn_backend("triton")
    kv = model.allocate_kv_cache(3000, BLOCK)
    cfg = GraphConfig(max_batch=16, max_k=5, max_model_len=1024, progress=False, piecewise=True)
    pw = build_scorers(["mqa"], model, kv, BLOCK, cfg)["mqa"]
    for n in (12, 3):
        reqs, props = decoding_batch(model, kv, rng, n, max_k=5, max_len=700)
        want = MQAScorer(model, clone_kv(kv), BLOCK).score(reqs, props)
        got = pw.score(reqs, props)
        err = rel_err(got, want)
        print(f"GPU {dtype} piecewise mqa vs eager mqa, {n} rows: rel. error {err:.2e}")
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert err < (1e-4 if dtype == torch.float32 else 1e-2), err
    print("GPU piecewise:", pw.piecewise.stats())
    assert pw.piecewise.num_replays == 2 and pw.piecewise.num_eager_fallbacks == 0


@gpu
@no_cuda
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_cuda_piecewise_mqa_greedy_equals_non_speculative(proposer):
    engine = check_greedy_equality("cuda", "mqa", proposer, piecewise=True)
    runner = engine.scorers["mqa"].piecewise
    print(f"GPU engine piecewise mqa/{proposer}:", runner.stats())
    assert runner.num_replays > 0 and runner.num_eager_fallbacks == 0
