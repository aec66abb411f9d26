"""The synthetic proposer's common random numbers: whether the draft of a prompt's output position is
right depends on (seed, prompt, position) only, not on what was proposed before it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from specsched.engine.request import Request, SamplingParams
from specsched.proposers.synthetic import SyntheticProposer

VOCAB = 1000


def target():
    return SimpleNamespace(
        cfg=SimpleNamespace(vocab_size=VOCAB), lm_head=SimpleNamespace(weight=torch.zeros(1))
    )


def oracle(num: int, length: int, seed: int = 0):
    rng = random.Random(seed)
    return [
        ([rng.randrange(VOCAB) for _ in range(8)], [rng.randrange(VOCAB) for _ in range(length)])
        for _ in range(num)
    ]


def at(prompt: list[int], cont: list[int], n: int) -> Request:
    """A request of ``prompt`` with the first ``n`` tokens of the continuation generated."""
    r = Request("r", list(prompt), SamplingParams(max_tokens=len(cont) + 1))
    r.output_ids.extend(cont[:n])
    return r


def draft_lists(props) -> list[list[int]]:
    cu, flat = props.cu_num_draft.tolist(), props.draft_tokens.tolist()
    return [flat[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]


def right(p: SyntheticProposer, prompt, cont, n: int, k: int) -> list[bool]:
    props = p.propose([at(prompt, cont, n)], [k])
    got = draft_lists(props)[0]
    return [d == t for d, t in zip(got, cont[n : n + k])]


def test_outcomes_depend_on_the_position_not_on_the_history():
    pairs = oracle(3, 64)
    a, b = (SyntheticProposer(target(), 0.7, 16, seed=5, oracle=pairs) for _ in range(2))
    prompt, cont = pairs[0]
    for n in range(0, 40, 3):  # a runs the request from the start; b sees other prompts and k first
        right(b, *pairs[1], n, 8)
        assert right(a, prompt, cont, n, 4) == right(b, prompt, cont, n, 8)[:4]
    # a draft of position p is right or wrong whichever step proposes it
    assert right(a, prompt, cont, 10, 6)[3:] == right(a, prompt, cont, 13, 3)


def test_the_rate_is_the_acceptance_and_wrong_drafts_are_wrong():
    pairs = oracle(20, 200, seed=1)
    p = SyntheticProposer(target(), 0.7, 16, seed=0, oracle=pairs)
    outcomes = [ok for prompt, cont in pairs for n in range(0, 200, 8) for ok in right(p, prompt, cont, n, 8)]
    assert len(outcomes) == 4000
    assert abs(sum(outcomes) / len(outcomes) - 0.7) < 0.03
    for prompt, cont in pairs[:3]:  # a wrong draft is another token of the vocabulary
        got = draft_lists(p.propose([at(prompt, cont, 0)], [8]))[0]
        assert all(0 <= d < VOCAB for d in got)


def test_another_seed_draws_other_outcomes():
    pairs = oracle(4, 100)
    one = SyntheticProposer(target(), 0.5, 16, seed=0, oracle=pairs)
    two = SyntheticProposer(target(), 0.5, 16, seed=1, oracle=pairs)
    a = [right(one, *pr, n, 8) for pr in pairs for n in range(0, 96, 8)]
    b = [right(two, *pr, n, 8) for pr in pairs for n in range(0, 96, 8)]
    assert a != b
    assert a == [
        right(SyntheticProposer(target(), 0.5, 16, seed=0, oracle=pairs), *pr, n, 8)
        for pr in pairs
        for n in range(0, 96, 8)
    ]


def test_off_the_oracle_path_nothing_is_drafted():
    pairs = oracle(1, 20)
    p = SyntheticProposer(target(), 1.0, 16, oracle=pairs)
    prompt, cont = pairs[0]
    off = at(prompt, [(t + 1) % VOCAB for t in cont], 3)
    assert draft_lists(p.propose([off], [4]))[0] == []
    assert p.peek([at(prompt, cont, 5)]).max_k == [15]
