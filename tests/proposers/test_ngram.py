"""Prompt lookup (n-gram) proposer on plain lists, against a brute-force reference."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from specsched.engine.config import NgramConfig
from specsched.engine.request import Request, SamplingParams
from specsched.proposers.ngram import LAZY_MAX, NgramIndex, NgramProposer, ngram_lookup, ngram_match


def brute_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Plain loops: longest n first, then the most recent earlier start."""
    if k == 0:
        return []
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_repeated_pattern_gives_continuation():
    assert ngram_lookup([1, 2, 3, 4, 5, 9, 1, 2, 3], 1, 3, 4) == [4, 5, 9, 1]


def test_longest_n_preferred_over_more_recent_shorter_match():
    # "7 8" occurs at 0 (followed by 1); "8" alone last occurred at 4 (followed by 2)
    tokens = [7, 8, 1, 5, 8, 2, 6, 7, 8]
    assert ngram_lookup(tokens, 1, 2, 1) == [1]
    assert ngram_lookup(tokens, 1, 1, 1) == [2]  # max_n = 1: most recent "8"


def test_most_recent_occurrence_chosen():
    assert ngram_lookup([5, 1, 5, 2, 5, 3, 5], 1, 4, 1) == [3]


def test_no_match_and_k_zero():
    assert ngram_lookup([1, 2, 3, 4], 1, 4, 5) == []
    assert ngram_lookup([1, 2, 1], 1, 4, 0) == []
    assert ngram_lookup([], 1, 4, 3) == []
    assert ngram_lookup([4], 1, 4, 3) == []


def test_k_caps_and_fewer_available():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert ngram_lookup(tokens, 1, 2, 2) == [3, 4]
    assert ngram_lookup(tokens, 1, 2, 100) == [3, 4, 5, 6, 1, 2]
    assert ngram_lookup([3, 3, 3], 1, 4, 5) == [3]  # overlapping match ends right before the suffix


def test_min_n_max_n_bounds():
    tokens = [9, 1, 2, 3, 8, 2, 3]  # suffix "2 3" matches at 2; "1 2 3" does not
    assert ngram_lookup(tokens, 3, 4, 2) == []  # min_n = 3: the 2-gram is not enough
    assert ngram_lookup(tokens, 2, 2, 2) == [8, 2]
    assert ngram_lookup([1, 2, 3, 1, 2, 3], 1, 2, 3) == [1, 2, 3]  # 3-gram would match too; 2 is the cap
    with pytest.raises(ValueError, match="min_n"):
        ngram_lookup(tokens, 0, 2, 1)
    with pytest.raises(ValueError, match="min_n"):
        ngram_lookup(tokens, 3, 2, 1)
    with pytest.raises(ValueError, match="k must be"):
        ngram_lookup(tokens, 1, 2, -1)


def test_matches_brute_force_on_random_sequences():
    rng = random.Random(0)
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(0, 10)
        expected = brute_lookup(tokens, min_n, max_n, k)
        assert ngram_lookup(tokens, min_n, max_n, k) == expected, (tokens, min_n, max_n, k)
        assert ngram_lookup(np.array(tokens, dtype=np.int64), min_n, max_n, k) == expected


def test_4k_context_under_a_millisecond():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, 4096)  # small vocab: many candidate positions
    ngram_lookup(tokens, 1, 4, 8)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(50):
            ngram_lookup(tokens, 1, 4, 8)
        best = min(best, (time.perf_counter() - t0) / 50)
    assert best < 1e-3, f"{best * 1e3:.3f} ms per lookup"


def make_request(rid: str, prompt: list[int], output: list[int] | None = None) -> Request:
    return Request(
        request_id=rid, prompt_ids=prompt, sampling=SamplingParams(), output_ids=list(output or [])
    )


def test_proposer_propose_and_peek_agree():
    prop = NgramProposer(NgramConfig(min_n=1, max_n=3))
    batch = [
        make_request("a", [1, 2, 3, 4, 5, 1, 2], [3]),  # continuation [4, 5, 1, 2, 3]
        make_request("b", [1, 2, 3, 4]),  # no match
        make_request("c", [6, 7, 6], [7]),  # "6 7" at 0 -> [6, 7]
    ]
    peek = prop.peek(batch)
    assert peek.max_k == [5, 0, 2]
    full = prop.propose(batch, [100, 100, 100])
    assert full.num_draft == peek.max_k
    out = prop.propose(batch, [3, 2, 0])
    assert out.num_draft == [3, 0, 0]
    assert out.draft_tokens.tolist() == [4, 5, 1]
    assert out.cu_num_draft.tolist() == [0, 3, 3, 3]
    assert out.draft_probs is None
    assert out.draft_tokens.dtype == torch.int64
    for req, ki in zip(batch, [3, 2, 0], strict=True):
        assert brute_lookup(req.token_ids, 1, 3, ki)[:ki] == ngram_lookup(req.token_ids, 1, 3, ki)


def test_proposer_follows_token_changes():
    prop = NgramProposer(NgramConfig(min_n=1, max_n=2))
    req = make_request("r", [1, 2, 3, 1])
    assert prop.propose([req], [2]).draft_tokens.tolist() == [2, 3]
    rng = random.Random(1)
    for _ in range(60):  # appends beyond the cached buffer
        req.output_ids.append(rng.randrange(6))
        got = prop.propose([req], [4]).draft_tokens.tolist()
        assert got == brute_lookup(req.token_ids, 1, 2, 4)
    req.output_ids[-3:] = [0, 1]  # shrunk in place (e.g. a stop string trimmed the output)
    assert prop.propose([req], [4]).draft_tokens.tolist() == brute_lookup(req.token_ids, 1, 2, 4)
    # same id, different tokens (e.g. a reused id): no stale cache
    other = make_request("r", [5, 6, 7, 5])
    assert prop.propose([other], [2]).draft_tokens.tolist() == [6, 7]
    same_shape = make_request("r", [5, 7, 6, 5])  # same length and last token, new content
    assert prop.propose([same_shape], [2]).draft_tokens.tolist() == [7, 6]
    shorter = make_request("r", [5, 6, 5])
    assert prop.propose([shorter], [2]).draft_tokens.tolist() == [6, 5]
    prop.on_finish(shorter)
    assert prop.propose([shorter], [2]).draft_tokens.tolist() == [6, 5]


def test_proposer_rejects_bad_k():
    prop = NgramProposer(NgramConfig())
    req = make_request("x", [1, 2, 1])
    with pytest.raises(ValueError, match="k must be >= 0"):
        prop.propose([req], [-1])
    with pytest.raises(ValueError, match="entries"):
        prop.propose([req], [1, 1])
    assert prop.name == "ngram"


def test_index_matches_the_scan_on_growing_sequences():
    """NgramIndex (incremental, both the looped and the vectorised indexing) == ngram_match."""
    rng = random.Random(2)
    for _ in range(60):
        vocab, min_n = rng.choice([2, 3, 7, 50]), rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        index = NgramIndex(min_n, max_n)
        tokens: list[int] = []
        for _ in range(rng.randint(1, 8)):
            tokens += [rng.randrange(vocab) for _ in range(rng.choice([1, 2, 5, 40, 90]))]
            arr = np.array(tokens, dtype=np.int64)
            assert index.match(arr) == ngram_match(arr, min_n, max_n), (tokens, min_n, max_n)
            # a match indexes a long stretch in bulk and leaves a short one to the next extend
            assert len(tokens) - 1 - LAZY_MAX <= index.num_indexed <= len(tokens) - 1


def test_unindexed_ends_are_compared_directly_and_win_as_the_most_recent():
    """The end positions after ``num_indexed`` (a decode step's committed tokens, indexed later by
    ``on_scoring``) are matched without indexing them: an unindexed occurrence of the suffix beats an
    indexed one of the same length (more recent), a longer indexed one beats a shorter unindexed one,
    and nothing is indexed by the match."""
    tokens = [5, 6, 7, 9, 5, 6, 7, 8, 1, 6, 7]  # suffix [6, 7]: at ends 2 (indexed) and 6 (not)
    index = NgramIndex(1, 3)
    index.extend(tokens, 4)  # ends 0..3 indexed
    assert index.match(tokens) == 7 == ngram_match(np.array(tokens), 1, 3)
    assert index.num_indexed == 4
    tokens = [5, 6, 7, 9, 1, 6, 7, 8, 5, 6, 7]  # [5, 6, 7] at end 2 (indexed) beats [6, 7] at end 6
    index = NgramIndex(1, 3)
    index.extend(tokens, 4)
    assert index.match(tokens) == 3 == ngram_match(np.array(tokens), 1, 3)
    tokens = [3, 3, 3, 3]  # runs: the occurrence may overlap the suffix, never be it
    index = NgramIndex(1, 4)
    assert index.match(tokens) == 3 == ngram_match(np.array(tokens), 1, 4)


def test_index_matches_the_scan_growing_by_a_decode_steps_tokens():
    """The engine's flow: on_scoring indexes the tokens known before the commit (sometimes it does not
    run: the host path), a step commits 1-9 tokens, then a match: always the scan's answer."""
    rng = random.Random(12)
    for _ in range(40):
        vocab, min_n = rng.choice([2, 3, 7, 50]), rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        index = NgramIndex(min_n, max_n)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        index.extend(tokens, len(tokens) - 1)
        for _ in range(60):
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
            assert index.match(tokens) == ngram_match(np.array(tokens), min_n, max_n), (tokens, min_n, max_n)
            if rng.random() < 0.7:
                index.extend(tokens, len(tokens))


def test_proposer_with_long_prompt_equals_brute_force():
    rng = random.Random(3)
    prop = NgramProposer(NgramConfig(min_n=1, max_n=4))
    req = make_request("long", [rng.randrange(12) for _ in range(300)])
    for _ in range(30):
        ks = rng.randint(0, 6)
        assert prop.propose([req], [ks]).draft_tokens.tolist() == brute_lookup(req.token_ids, 1, 4, ks)
        req.output_ids += [rng.randrange(12) for _ in range(rng.randint(1, 4))]


def test_index_one_dict_for_every_n():
    """NgramIndex keeps every n in one dict: n-grams of different n (runs of one token, zeros, large
    ids) never share a key; growing by few and by many positions."""
    rng = random.Random(4)
    big = [0, 1, 2**31, 2**32 - 2, 2**32 - 3, 2**20]
    for _ in range(80):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        index = NgramIndex(min_n, max_n)
        tokens: list[int] = []
        for _ in range(rng.randint(1, 6)):
            tokens += [rng.choice(big) for _ in range(rng.choice([1, 3, 20, 50]))]
            want = ngram_match(np.array(tokens, dtype=np.uint64), min_n, max_n)
            assert index.match(tokens) == want, (tokens, min_n, max_n)


def test_on_scoring_indexes_ahead_without_changing_the_drafts():
    """on_scoring (the n-grams ending at the last token, indexed before the commit) leaves every
    later peek and proposal equal to brute force, also when the tokens do not grow after it."""
    rng = random.Random(5)
    prop = NgramProposer(NgramConfig(min_n=1, max_n=3))
    reqs = [make_request(f"s{i}", [rng.randrange(5) for _ in range(rng.randint(2, 30))]) for i in range(4)]
    for step in range(40):
        peek = prop.peek(reqs)
        ks = [rng.randint(0, 5) for _ in reqs]
        got = prop.propose(reqs, ks)
        want = [brute_lookup(r.token_ids, 1, 3, k) for r, k in zip(reqs, ks)]
        assert got.draft_tokens.tolist() == [t for w in want for t in w], step
        assert peek.max_k == [len(brute_lookup(r.token_ids, 1, 3, 1 << 20)) for r in reqs]
        prop.on_scoring(reqs)
        if step % 5 == 4:  # no commit after the scoring (not the engine's flow): still exact
            assert prop.peek(reqs).max_k == peek.max_k
            assert prop.propose(reqs, ks).draft_tokens.tolist() == got.draft_tokens.tolist()
        for r in reqs:
            r.output_ids += [rng.randrange(5) for _ in range(rng.randint(1, 3))]
    for r in reqs:  # the index itself, asked again after indexing the last token: the scan's answer
        index = NgramIndex(1, 3)
        tokens = r.token_ids
        index.extend(tokens, len(tokens))
        assert index.match(tokens) == ngram_match(np.array(tokens), 1, 3)
    other = make_request("s0", [1, 2, 1])  # another Request under a known id: left alone, rebuilt later
    prop.on_scoring([other])
    assert prop.propose([other], [2]).draft_tokens.tolist() == [2, 1]


def test_on_prefill_indexes_the_prompt_without_changing_the_drafts():
    """on_prefill (the prompt indexed while the GPU prefills) leaves the index one end position short
    of the tokens, so the first peek indexes at most the prefill's token, and every later peek and
    proposal equals brute force: fresh prompts, a request prefilled again without a new token (a
    preemption), and one whose tokens changed under the same id."""
    rng = random.Random(6)
    prop = NgramProposer(NgramConfig(min_n=1, max_n=4))
    reqs = [make_request(f"p{i}", [rng.randrange(6) for _ in range(rng.randint(1, 60))]) for i in range(6)]
    prop.on_prefill(reqs)
    for r in reqs:
        assert prop._cache[r.request_id].index.num_indexed == max(len(r.prompt_ids) - 1, 0)
    for step in range(30):
        if step == 10:  # preempted and prefilled again: the tokens do not grow before the next peek
            prop.on_prefill(reqs[:2])
        if step == 20:  # same id, other tokens: the entry is rebuilt
            reqs[3] = make_request("p3", [rng.randrange(6) for _ in range(25)])
            prop.on_prefill([reqs[3]])
        peek = prop.peek(reqs)
        assert peek.max_k == [len(brute_lookup(r.token_ids, 1, 4, 1 << 20)) for r in reqs], step
        ks = [rng.randint(0, 6) for _ in reqs]
        want = [brute_lookup(r.token_ids, 1, 4, k) for r, k in zip(reqs, ks)]
        assert prop.propose(reqs, ks).draft_tokens.tolist() == [t for w in want for t in w], step
        if step not in (9, 19):
            for r in reqs:
                r.output_ids += [rng.randrange(6) for _ in range(rng.randint(1, 5))]


def test_a_finished_requests_entry_is_freed_off_the_commit():
    """on_finish drops the entry (a new request under the id starts afresh) but frees it only in the
    next on_scoring or on_prefill; past MAX_FINISHED waiting entries it frees them at once."""
    from specsched.proposers.ngram import MAX_FINISHED

    prop = NgramProposer(NgramConfig(min_n=1, max_n=3))
    reqs = [make_request(f"f{i}", [1, 2, 3, 1, 2]) for i in range(3)]
    prop.peek(reqs)
    prop.on_finish(reqs[0])
    assert "f0" not in prop._cache and len(prop._finished) == 1
    again = make_request("f0", [7, 8, 7])  # the id reused: its own tokens, not the finished ones
    assert prop.propose([again], [2]).draft_tokens.tolist() == [8, 7]
    prop.on_scoring(reqs[1:])
    assert prop._finished == []
    prop.on_finish(reqs[1])
    prop.on_prefill([make_request("p", [4, 5])])
    assert prop._finished == []
    prop.on_finish(make_request("never-seen", [1]))  # no entry: nothing to free
    assert prop._finished == []
    many = [make_request(f"m{i}", [1, 2, 1]) for i in range(MAX_FINISHED + 1)]
    prop.peek(many)
    for r in many[:MAX_FINISHED]:
        prop.on_finish(r)
    assert len(prop._finished) == MAX_FINISHED
    prop.on_finish(many[-1])  # one past the bound: all freed at once
    assert prop._finished == []
