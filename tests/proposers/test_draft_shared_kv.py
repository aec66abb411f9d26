"""A self-draft sharing the target's KV cache (``draft.shared_kv``, the default): the target's K/V of
committed positions are never written by a propose, the catch-up after a prefill feeds one token (not
the prompt), and the engine sizes no second cache. (Greedy speculative output equal to non-speculative
output, both scorers, shared and own cache: tests/engine/test_engine.py.)"""

from __future__ import annotations

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
from specsched.engine.request import Request, SamplingParams
from specsched.proposers import draft as draft_module

BLOCK, LAYERS = 4, 2


def make_engine(shared: bool, num_blocks: int | None = 256, cpu_kv_gb: float = 1.0) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
            cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, cpu_kv_gb=cpu_kv_gb),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
            spec=SpecConfig(
                proposer="draft",
                scorers=["batch_expansion", "mqa"],
                max_k=4,
                draft=DraftConfig(source="self", num_layers=LAYERS, shared_kv=shared),
            ),  # fmt: skip
            policy={"name": "fixed", "k": 3, "scorer": "mqa"},
        )
    )


def committed_kv(engine: Engine, req: Request) -> list[torch.Tensor]:
    """The K and V of ``req``'s positions the target has computed, in the draft's layers (copies)."""
    out = []
    for k, v in engine.kv_cache[:LAYERS]:  # [num_blocks, block, heads, dim] each
        for t in (k, v):
            rows = [t[req.block_table[p // BLOCK], p % BLOCK] for p in range(req.num_computed)]
            out.append(torch.stack(rows).clone())
    return out


def test_config_validates_shared_kv():
    assert DraftConfig().shared_kv is True
    with pytest.raises(ValueError, match="draft.shared_kv must be true or false, got 'no'"):
        DraftConfig(shared_kv="no")


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "own"])
def test_proposes_never_write_the_targets_committed_kv_and_shared_catch_up_is_one_token(shared, monkeypatch):
    engine = make_engine(shared)
    draft = engine.proposers["draft"]
    assert draft.is_shared_kv is shared
    assert (draft.kv_cache[0][0] is engine.kv_cache[0][0]) is shared
    fed: list[list[int]] = []
    real = draft_module.chunk_host_inputs

    def spy(tokens, starts, *args, **kwargs):
        fed.append([len(t) for t in tokens])
        return real(tokens, starts, *args, **kwargs)

    monkeypatch.setattr(draft_module, "chunk_host_inputs", spy)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 7, 8, 9]
    req = Request("a", prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    engine.add_request(req)
    engine.step()  # the prefill
    assert req.num_computed == len(prompt) and not fed
    for k, v in engine.kv_cache[:LAYERS]:  # marks a draft's rewrite would erase (the same values else)
        for p in range(req.num_computed):
            k[req.block_table[p // BLOCK], p % BLOCK] += 1000.0
            v[req.block_table[p // BLOCK], p % BLOCK] -= 1000.0
    for step in range(6):
        before = committed_kv(engine, req)
        kept, ks = engine.scheduler.reserve_lookahead([req], [3])  # the blocks the drafts write into
        assert kept == [req]
        draft.propose([req], ks)
        after = committed_kv(engine, req)
        assert all(torch.equal(a, b) for a, b in zip(before, after)), f"step {step}: committed K/V written"
        if step == 0:  # the first catch-up: the last token only when shared, the whole prompt + it if not
            assert fed[-1] == ([1] if shared else [len(prompt) + 1])
        draft.on_commit([req])  # roll back what this probe drafted; the engine's step drafts anew
        engine.step()
    assert all(n == [1] for n in fed[1:]) if shared else True
    while engine.has_unfinished:
        engine.step()


def test_a_shared_self_draft_leaves_the_whole_budget_to_the_target():
    shared = make_engine(True, num_blocks=None, cpu_kv_gb=0.01)
    own = make_engine(False, num_blocks=None, cpu_kv_gb=0.01)
    layers = shared.model.cfg.num_layers
    # own: each block holds target + draft layers; shared: target layers only
    assert shared.num_total_blocks / own.num_total_blocks == pytest.approx(
        (layers + LAYERS) / layers, rel=0.02
    )
    assert len(own.proposers["draft"].kv_cache) == LAYERS


def test_a_shared_self_draft_on_the_loop_graphs_proposes_in_one_replay():
    """``draft.loop_graphs`` (emulated on the CPU) with the shared cache: the catch-up is the last
    committed token, a step like the others, so each propose is one replay of the loop graphs (the
    draft's own graphs replay no catch-up), and the output is the non-speculative one."""
    from specsched.engine.request import SpecParams
    from specsched.scorers.graph import GraphConfig, attach_draft_graphs

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 7, 8, 9], [20, 21, 22, 20, 21], [40, 41, 42, 43, 44, 45, 46]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (19, 11, 14)]
    want = make_engine(True).generate(prompts, params, SpecParams(proposer="none"))
    engine = make_engine(True)
    draft = engine.proposers["draft"]
    gcfg = GraphConfig(max_batch=4, max_k=4, max_model_len=128, emulate=True, progress=False, draft_loop=True)
    fwd = attach_draft_graphs(draft, gcfg, BLOCK)
    records = []
    engine.on_step = records.append
    assert engine.generate(prompts, params) == want
    drafted = [r for r in records if r.kind == "decode" and any(q.k for q in r.requests)]
    assert drafted and draft.loop_graphs.num_replays == len(drafted) and draft.loop_graphs.num_misses == 0
    assert fwd.runner.num_replays == 0 and fwd.num_eager_calls == 0  # no catch-up forward of its own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scorer", ["batch_expansion", "mqa_graph"])
def test_cuda_shared_self_draft_on_the_loop_graphs_is_lossless(scorer):
    """The daemon's build (build_parts: graphs captured, ``draft.loop_graphs=true``) on a GPU: the
    shared self-draft proposes in one replay a step and greedy output equals non-speculative."""
    from specsched.engine.request import SpecParams

    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cuda", dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
        spec=SpecConfig(proposer="draft", scorers=["batch_expansion", "mqa_graph"], max_k=4,
                        draft=DraftConfig(source="self", num_layers=LAYERS, loop_graphs=True)),
        policy={"name": "fixed", "k": 3, "scorer": scorer},
    )  # fmt: skip
    engine = Engine(cfg)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 7, 8, 9], [20, 21, 22, 20, 21], [40, 41, 42, 43, 44, 45, 46]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (19, 11, 14)]
    want = engine.generate(prompts, params, SpecParams(proposer="none"))
    assert engine.generate(prompts, params) == want
    loop = engine.proposers["draft"].loop_graphs
    print("GPU shared self-draft loop:", loop.stats())
    assert loop.num_replays > 0 and loop.num_misses == 0
