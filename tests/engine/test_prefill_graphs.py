"""The engine's prefill on graphs (``Engine.prefill_runner``; emulated on CPU): the same greedy output
as the eager prefill, chunks that fit a bucket replayed, the others run eagerly and counted; an
engine built with the runner schedules no chunk set the graphs do not take."""

from __future__ import annotations

from specsched.engine.components import build_parts
from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.request import SamplingParams
from specsched.models.cuda_graphs import GraphRunner
from specsched.models.graph_buckets import prefill_buckets
from specsched.scorers.graph import GraphConfig

BLOCK = 4


def engine_config(proposer: str = "ngram", chunk: int = 64) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, num_blocks=400),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=chunk),
        spec=SpecConfig(proposer=proposer, scorers=["batch_expansion", "mqa"], max_k=4),
        policy={"name": "goodput"},
    )


def make_engine(proposer: str = "ngram", chunk: int = 64) -> Engine:
    return Engine(engine_config(proposer, chunk))


def prefill_runner(model, kv_cache, max_model_len: int, max_rows: int, max_tokens: int) -> GraphRunner:
    width = -(-max_model_len // BLOCK)
    return GraphRunner(
        model, kv_cache, prefill_buckets(max_rows, max_tokens), width,
        emulate=True, progress=False, last_token_logits=True,
    )  # fmt: skip


def with_prefill_graphs(engine: Engine, max_rows: int, max_tokens: int) -> GraphRunner:
    """The runner set after the engine is built: the scheduler does not know its limits."""
    e = engine
    e.prefill_runner = prefill_runner(e.model, e.kv_cache, e.max_model_len, max_rows, max_tokens)
    return e.prefill_runner


PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7, [12, 13, 14, 15, 16] * 5, [20, 21] * 30, [30] * 3]
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


def test_prefill_on_graphs_is_lossless_and_falls_back_beyond_the_buckets():
    want = make_engine("none").generate(PROMPTS, PARAMS)
    engine = make_engine()
    runner = with_prefill_graphs(engine, max_rows=2, max_tokens=32)
    assert engine.generate(PROMPTS, PARAMS) == want
    # the 60-token prompt and chunks of more than 2 prompts run eagerly; the rest replayed
    assert runner.num_replays > 0 and runner.num_eager_fallbacks > 0
    assert set(runner.fallback_reasons) <= {"tokens above largest bucket", "rows above largest bucket"}


def test_a_mid_prompt_chunk_samples_nothing_and_its_prompt_still_decodes_alike():
    # a chunk budget of 16 splits the 60-token prompt: chunks that end mid-prompt sample no token
    want = make_engine("none", chunk=16).generate(PROMPTS[3:], PARAMS)
    engine = make_engine(chunk=16)
    runner = with_prefill_graphs(engine, max_rows=4, max_tokens=32)
    assert engine.generate(PROMPTS[3:], PARAMS) == want
    assert runner.num_replays >= 4 and runner.num_eager_fallbacks == 0


def test_an_engine_built_with_prefill_graphs_keeps_every_chunk_on_them():
    # 5 prompts (one of 60 tokens) with graphs of <= 2 prompts x 32 tokens: the scheduler splits the
    # work into chunk sets the graphs take, so nothing runs eagerly, and the output is the same
    want = make_engine("none").generate(PROMPTS, PARAMS)
    cfg = engine_config()
    parts = build_parts(cfg)
    parts.prefill_runner = prefill_runner(parts.model, parts.kv_cache, parts.max_model_len, 2, 32)
    engine = Engine(cfg, parts)
    sizes: list[tuple[int, int]] = []
    engine.on_step = lambda r: sizes.append((r.batch_size, r.num_tokens)) if r.kind == "prefill" else None
    assert engine.generate(PROMPTS, PARAMS) == want
    runner = engine.prefill_runner
    assert runner.num_eager_fallbacks == 0 and runner.num_replays == len(sizes) >= 4
    assert max(r for r, _ in sizes) == 2 and max(t for _, t in sizes) == 32


def test_graph_config_sizes_prefill_from_the_engine_config():
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", prefill_graph_tokens=256),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
    )
    g = GraphConfig.for_engine(cfg, 1024)
    assert (g.prefill_rows, g.prefill_tokens) == (4, 128)
    wide = EngineConfig(model=ModelConfig(source="tiny", device="cpu", prefill_graph_rows=8))
    g = GraphConfig.for_engine(wide, 1024)
    assert (g.prefill_rows, g.prefill_tokens) == (8, 2048)
    off = EngineConfig(model=ModelConfig(source="tiny", device="cpu", prefill_graph_tokens=0))
    assert GraphConfig.for_engine(off, 1024).prefill_tokens == 0
