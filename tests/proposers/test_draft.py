"""Draft-model proposer, greedy: drafts chained on the device (no host read) equal a dense reference
(the draft model's greedy continuation, recomputed from scratch per token), for ragged k (0
included), eagerly and on (emulated) CUDA graphs; the drafts come back in request-major order."""

from __future__ import annotations

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specsched.engine.request import Request, SamplingParams
from specsched.kernels.metadata import build_metadata
from specsched.models.config import get_preset
from specsched.models.llama import LlamaForCausalLM
from specsched.models.random_init import init_random
from specsched.proposers.draft import DraftModelProposer
from specsched.scorers.graph import GraphConfig, attach_draft_graphs

BLOCK = 4
LAYERS = 2


class CountHostReads(TorchFunctionMode):
    """Reads of tensor values on the host (each a sync when the tensor is on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("tolist", "item", "numpy", "__int__", "__bool__", "cpu"):
            self.num_reads += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return init_random(LlamaForCausalLM(get_preset("tiny")).eval(), seed=1, std=0.1).requires_grad_(False)


def dense_greedy(model: LlamaForCausalLM, tokens: list[int], k: int) -> list[int]:
    """k greedy tokens of the first LAYERS layers + head, each from a fresh dense forward."""
    seq, out = list(tokens), []
    for _ in range(k):
        n = len(seq)
        nb = -(-n // BLOCK) + 1
        meta = build_metadata([n], [n], [list(range(1, nb))], BLOCK)
        kv = model.allocate_kv_cache(nb, BLOCK, LAYERS)
        with torch.inference_mode():
            logits = model(
                torch.tensor(seq), torch.arange(n), meta, kv, torch.tensor([n - 1]), num_layers=LAYERS
            )
        out.append(int(logits[0].argmax()))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize("graphs", ["eager", "graphs", "loop"])
@pytest.mark.parametrize("seed", range(3))
def test_greedy_drafts_on_device_equal_dense_reference(model, seed, graphs):
    """``loop``: drafts 2..k of each propose in one (emulated) replay of the draft loop graphs
    (models/draft_loop.py), rows of ragged k (0 and 1 among them) stopping in place."""
    rng = random.Random(seed)
    num_blocks = 300
    prop = DraftModelProposer(model, model.allocate_kv_cache(num_blocks, BLOCK, LAYERS), BLOCK, LAYERS)
    if graphs != "eager":
        cfg = GraphConfig(max_batch=8, max_k=6, max_model_len=128, emulate=True, progress=False,
                          draft_loop=graphs == "loop")  # fmt: skip
        fwd = attach_draft_graphs(prop, cfg, BLOCK)
        assert (prop.loop_graphs is not None) == (graphs == "loop")
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    reqs = []
    for i in range(rng.randint(2, 6)):
        prompt = [rng.randrange(3, 256) for _ in range(rng.randint(2, 30))]
        r = Request(f"d{i}", prompt, SamplingParams(), block_table=[free.pop() for _ in range(12)])
        r.num_computed = len(prompt) - 1
        reqs.append(r)
    num_looped = 0
    for round_ in range(2):  # the second round starts from the draft KV the first one left
        ks = [rng.choice([0, 1, rng.randint(0, 6), 6]) for _ in reqs]
        num_looped += max(ks) >= 2
        counter = CountHostReads()
        with counter:
            out = prop.propose(reqs, ks)
        assert counter.num_reads == 0, "greedy drafts must not be read on the host"
        assert out.num_draft == ks and out.cu_num_draft.tolist()[-1] == sum(ks) and out.draft_probs is None
        flat, cu = out.draft_tokens.tolist(), out.cu_num_draft.tolist()
        for i, (r, k) in enumerate(zip(reqs, ks, strict=True)):
            assert flat[cu[i] : cu[i + 1]] == dense_greedy(model, r.token_ids, k), (round_, i, ks)
        for r, k in zip(reqs, ks, strict=True):  # accept one draft (or the bonus) and commit
            r.output_ids.append(flat[cu[reqs.index(r)]] if k else rng.randrange(3, 256))
            r.num_computed = r.num_tokens - 1
        prop.on_commit(reqs)
    if graphs == "graphs":
        assert fwd.runner.num_replays > 0 and fwd.runner.num_eager_fallbacks == 0
    if graphs == "loop":  # the runner replays catch-ups only; every propose with a k >= 2 ran its
        # drafts 2.. in one replay of the loop graphs
        assert fwd.runner.num_eager_fallbacks == 0
        assert prop.loop_graphs.num_replays == num_looped and prop.loop_graphs.num_misses == 0


def test_a_draft_with_its_loop_switched_off_proposes_step_by_step(model):
    """``is_loop_used`` False (a benchmark's A/B of one shared draft): the loop graphs stay captured
    and are not replayed; the drafts are the same tokens."""
    prop = DraftModelProposer(model, model.allocate_kv_cache(40, BLOCK, LAYERS), BLOCK, LAYERS)
    cfg = GraphConfig(max_batch=4, max_k=4, max_model_len=64, emulate=True, progress=False, draft_loop=True)
    attach_draft_graphs(prop, cfg, BLOCK)
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(3)]
    reqs = [
        Request(f"s{i}", [5 + i, 9, 11, 7 + i], SamplingParams(), block_table=t) for i, t in enumerate(tables)
    ]
    for ks in ([4, 2, 3], [3, 3, 3]):  # ragged k (an index reorders), one k (a transpose does)
        drafts = []
        for is_used in (True, False):
            prop.is_loop_used = is_used
            for r in reqs:
                r.num_draft_computed = 0
            drafts.append(prop.propose(reqs, ks).draft_tokens.tolist())
        assert drafts[0] == drafts[1] and len(drafts[0]) == sum(ks)
    assert prop.loop_graphs.num_replays == 2


@pytest.mark.parametrize("seed", [0, 1, "too_many_rows"])
def test_a_shared_self_drafts_whole_propose_on_the_loop_graphs_equals_dense_reference(model, seed):
    """A self-draft on the target's cache (``is_shared_kv``) with the loop graphs: its catch-up is the
    last committed token, so all k drafts come from one replay (none from its own graphs), and they
    are the dense reference's, ragged k (0 and 1 among them)."""
    is_miss = seed == "too_many_rows"  # more rows than the graphs: step by step, one miss counted
    rng = random.Random(100 + (7 if is_miss else seed))
    kv = model.allocate_kv_cache(300, BLOCK, LAYERS)  # the target's cache of the draft's layers
    prop = DraftModelProposer(model, kv, BLOCK, LAYERS, is_shared_kv=True)
    cfg = GraphConfig(max_batch=1 if is_miss else 8, max_k=6, max_model_len=128, emulate=True, progress=False,
                      draft_loop=True)  # fmt: skip
    fwd = attach_draft_graphs(prop, cfg, BLOCK)
    free = list(range(1, 300))
    rng.shuffle(free)
    reqs = []
    for i in range(rng.randint(2, 6)):
        prompt = [rng.randrange(3, 256) for _ in range(rng.randint(2, 30))]
        r = Request(f"s{i}", prompt, SamplingParams(), block_table=[free.pop() for _ in range(12)])
        n = len(prompt) - 1  # the target computed the prompt but its last token (a prefill's K/V)
        meta = build_metadata([n], [n], [r.block_table], BLOCK)
        with torch.inference_mode():
            model(torch.tensor(prompt[:n]), torch.arange(n), meta, kv, None, num_layers=LAYERS)
        r.num_computed = n
        reqs.append(r)
    ks = [rng.choice([0, 1, rng.randint(0, 6), 6]) for _ in reqs]
    ks[0] = 6
    out = prop.propose(reqs, ks)
    flat, cu = out.draft_tokens.tolist(), out.cu_num_draft.tolist()
    for i, (r, k) in enumerate(zip(reqs, ks, strict=True)):
        assert flat[cu[i] : cu[i + 1]] == dense_greedy(model, r.token_ids, k), (i, ks)
        assert r.num_draft_computed == (r.num_tokens - 1 + k if k else 0)
    if is_miss:  # the catch-up and the single steps ran on the draft's own graphs
        assert (prop.loop_graphs.num_replays, prop.loop_graphs.num_misses) == (0, 1)
        assert fwd.runner.num_replays + fwd.runner.num_eager_fallbacks > 0
    else:
        assert prop.loop_graphs.num_replays == 1 and fwd.runner.num_replays == 0 and fwd.num_eager_calls == 0
