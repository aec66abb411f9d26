"""The synthetic proposer's oracle from a file (``spec.synthetic_oracle``): the loader's checks, and an
engine built with it drafts the target's own greedy continuation (accepted, output unchanged)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.request import Request, SamplingParams
from specsched.proposers.synthetic import SyntheticProposer, load_oracle


def write(tmp_path, data, name="oracle.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_load_oracle_reads_the_bench_format(tmp_path):
    p = write(tmp_path, {"prompts": [[1, 2, 3], [4]], "outputs": [[5, 6], []]})
    assert load_oracle(p) == [([1, 2, 3], [5, 6]), ([4], [])]
    assert load_oracle(str(p)) == load_oracle(p)


@pytest.mark.parametrize(
    "data,match",
    [
        ("{not json", "not valid JSON"),
        ([[1, 2], [3]], "must be"),
        ({"prompts": [[1]]}, "must be"),
        ({"prompts": [[1], [2]], "outputs": [[3]]}, "2 prompts but 1 outputs"),
        ({"prompts": [[1, "2"]], "outputs": [[3]]}, r"prompts\[0\] must be a list of non-negative int"),
        ({"prompts": [[1]], "outputs": [[3.0]]}, r"outputs\[0\] must be a list of non-negative int"),
        ({"prompts": [[1]], "outputs": [[True]]}, r"outputs\[0\]"),
        ({"prompts": [[1]], "outputs": [[-1]]}, r"outputs\[0\]"),
        ({"prompts": [[1]], "outputs": [3]}, r"outputs\[0\]"),
        ({"prompts": [[]], "outputs": [[3]]}, r"prompts\[0\] is empty"),
        ({"prompts": [[1], [1]], "outputs": [[3], [4]]}, r"prompts\[1\] repeats"),
        ({"prompts": {"a": 1}, "outputs": []}, "must be lists"),
    ],
)
def test_load_oracle_rejects_bad_files_naming_the_problem(tmp_path, data, match):
    p = write(tmp_path, data)
    with pytest.raises(ValueError, match=match) as e:
        load_oracle(p)
    assert str(p) in str(e.value)


def test_load_oracle_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not found.*nope.json"):
        load_oracle(tmp_path / "nope.json")


def test_spec_config_rejects_an_empty_path():
    with pytest.raises(ValueError, match="spec.synthetic_oracle"):
        SpecConfig(proposer="synthetic", synthetic_oracle="")


def make_engine(**spec) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
            cache=CacheConfig(block_size=4, num_blocks=256),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
            spec=SpecConfig(scorers=["batch_expansion", "mqa"], max_k=8, **spec),
            policy={"name": "fixed", "k": 4, "scorer": "mqa"},
        )
    )


def test_engine_with_an_oracle_file_speculates_losslessly(tmp_path):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    params = [SamplingParams(max_tokens=16, ignore_eos=True) for _ in prompts]
    want = make_engine(proposer="none").generate(prompts, params)
    oracle = write(tmp_path, {"prompts": prompts, "outputs": want})

    engine = make_engine(proposer="synthetic", synthetic_acceptance=1.0, synthetic_oracle=str(oracle))
    assert isinstance(engine.proposers["synthetic"], SyntheticProposer)
    reqs = [Request(f"r{i}", p, SamplingParams(**vars(sp))) for i, (p, sp) in enumerate(zip(prompts, params))]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished:
        engine.step()
    assert [r.output_ids for r in reqs] == want
    assert sum(r.num_accepted for r in reqs) > 0
    assert sum(r.num_accepted for r in reqs) == sum(r.num_proposed for r in reqs)  # a = 1.0

    # without the file the same engine has nothing to draft
    bare = make_engine(proposer="synthetic", synthetic_acceptance=1.0)
    reqs = [Request(f"b{i}", p, SamplingParams(**vars(sp))) for i, (p, sp) in enumerate(zip(prompts, params))]
    for r in reqs:
        bare.add_request(r)
    while bare.has_unfinished:
        bare.step()
    assert [r.output_ids for r in reqs] == want
    assert sum(r.num_proposed for r in reqs) == 0


def test_engine_with_a_bad_oracle_file_fails_at_build(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        make_engine(proposer="synthetic", synthetic_oracle=str(tmp_path / "missing.json"))


def test_the_path_check_is_incremental_and_an_off_path_request_stays_off():
    """Each request's prompt is looked up once and only its new output tokens are compared; a request
    whose output leaves the oracle's continuation gets no drafts from then on, and a finished
    request's entry goes."""
    from types import SimpleNamespace

    target = SimpleNamespace(
        cfg=SimpleNamespace(vocab_size=50), lm_head=SimpleNamespace(weight=torch.zeros(1))
    )
    prop = SyntheticProposer(target, 1.0, 4, oracle=[([3, 4, 5], [10, 11, 12, 13, 14, 15])])
    lookups = []
    real_get = prop._oracle.get
    prop._oracle = type(
        "Counting", (dict,), {"get": lambda self, k, d=None: lookups.append(k) or real_get(k, d)}
    )(prop._oracle)
    on = Request("on", [3, 4, 5], SamplingParams(max_tokens=6))
    off = Request("off", [3, 4, 5], SamplingParams(max_tokens=6))
    other = Request("other", [7, 8], SamplingParams(max_tokens=6))
    batch = [on, off, other]
    assert prop.peek(batch).max_k == [6, 6, 0]
    on.output_ids += [10, 11]
    off.output_ids += [10, 99]  # leaves the path at its second token
    assert prop.peek(batch).max_k == [4, 0, 0]
    assert prop.propose(batch, [2, 2, 2]).num_draft == [2, 0, 0]
    on.output_ids += [12]
    off.output_ids[1] = 11  # back on the oracle's tokens: still off (it left the path once)
    assert prop.peek(batch).max_k == [3, 0, 0]
    assert prop.propose(batch, [3, 3, 3]).draft_tokens.tolist() == [13, 14, 15]
    assert len(lookups) == 3  # one prompt lookup per request over 5 calls
    for r in batch:
        prop.on_finish(r)
    assert prop._paths == {}
