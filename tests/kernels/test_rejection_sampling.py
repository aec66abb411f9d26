"""Greedy and sampled verification: hand-built cases, equality with plain greedy decoding, and
chi-square tests that rejection sampling preserves the target distribution (with a power check)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from specsched.engine.request import SamplingParams
from specsched.kernels.rejection_sampling import verify, verify_greedy, verify_sampled
from specsched.kernels.sampling import SamplingTensors, logits_to_probs, sample_from_probs
from specsched.proposers.base import Proposals

N_DRAWS = 100_000


def chi2_pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    """Chi-square goodness of fit of ``counts`` to ``p`` (categories with p == 0 must be empty)."""
    assert counts[p == 0].sum() == 0, "a zero-probability token was emitted"
    mask = p > 0
    exp = counts.sum() * p[mask] / p[mask].sum()
    stat = float(((counts[mask] - exp) ** 2 / exp).sum())
    df = int(mask.sum()) - 1
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, df))
    except ImportError:  # regularized upper incomplete gamma Q(df/2, stat/2)
        a, x = torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        return float(torch.special.gammaincc(a, x))


def logits_with_argmax(argmaxes: list[int], vocab: int = 10, seed: int = 0) -> torch.Tensor:
    """Random logits whose row r has its maximum at ``argmaxes[r]``."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(argmaxes), vocab, generator=gen)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize(
    "drafts, argmaxes, expected, bits",
    [
        ([3, 1, 4], [3, 1, 4, 2], [3, 1, 4, 2], "111"),  # all accepted -> bonus
        ([3, 1, 4], [3, 5, 4, 2], [3, 5], "10"),  # first mismatch -> target token
        ([3, 1, 4], [7, 1, 4, 2], [7], "0"),
        ([], [6], [6], ""),  # k = 0: plain decode
    ],
)
def test_verify_greedy_hand_built(drafts, argmaxes, expected, bits):
    res = verify_greedy(logits_with_argmax(argmaxes), Proposals.from_lists([drafts]))
    assert res.to_lists() == [expected]
    assert res.match_bits() == [bits]
    assert res.num_accepted.tolist() == [len(expected) - 1]
    assert res.num_emitted.tolist() == [len(expected)]
    assert res.output_tokens.shape == (1, len(drafts) + 1)
    assert res.output_tokens[0].tolist() == expected + [-1] * (len(drafts) + 1 - len(expected))


def test_verify_greedy_ragged_k0_and_k8():
    drafts = [[], [1, 2, 3, 4, 5, 6, 7, 8], [], [8, 7, 6, 5, 4, 3, 2, 1]]
    argmaxes = [[9], [1, 2, 3, 4, 5, 6, 7, 8, 0], [4], [8, 7, 6, 0, 4, 3, 2, 1, 9]]
    res = verify_greedy(logits_with_argmax([t for a in argmaxes for t in a]), Proposals.from_lists(drafts))
    assert res.to_lists() == [[9], [1, 2, 3, 4, 5, 6, 7, 8, 0], [4], [8, 7, 6, 0]]
    assert res.match_bits() == ["", "11111111", "", "1110"]
    assert res.output_tokens.shape == (4, 9)
    assert res.num_accepted.tolist() == [0, 8, 0, 3]


def toy_logits(prefix: list[int], vocab: int) -> torch.Tensor:
    """A deterministic 'model': next-token logits as a function of the whole prefix."""
    gen = torch.Generator().manual_seed(hash(tuple(prefix)) % (2**31))
    return torch.randn(vocab, generator=gen)


def test_speculative_greedy_equals_plain_greedy():
    rng, vocab, num_steps = random.Random(0), 12, 12
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 5))] for _ in range(6)]
    plain = []  # long enough for num_steps steps of up to 9 tokens each
    for prompt in prompts:
        seq = list(prompt)
        while len(seq) < len(prompt) + 9 * num_steps + 8:
            seq.append(int(toy_logits(seq, vocab).argmax()))
        plain.append(seq)

    seqs = [list(p) for p in prompts]
    for _ in range(num_steps):
        drafts = []
        for s, true in zip(seqs, plain, strict=True):  # each draft right 70% of the time
            k = rng.randint(0, 8)
            drafts.append(
                [true[len(s) + j] if rng.random() < 0.7 else rng.randrange(vocab) for j in range(k)]
            )
        rows = [
            toy_logits(s + d[:j], vocab) for s, d in zip(seqs, drafts, strict=True) for j in range(len(d) + 1)
        ]
        res = verify_greedy(torch.stack(rows), Proposals.from_lists(drafts))
        for s, out in zip(seqs, res.to_lists(), strict=True):
            s.extend(out)
    assert sum(len(s) - len(p) for s, p in zip(seqs, prompts, strict=True)) > 2 * num_steps * len(prompts)
    for s, true in zip(seqs, plain, strict=True):
        assert s == true[: len(s)]


# ---------------------------------------------------------------- sampled: distribution

P0 = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05])
Q0 = np.array([0.05, 0.10, 0.10, 0.15, 0.20, 0.15, 0.25])


def target_p(j: int, truncated: bool) -> np.ndarray:
    p = np.roll(P0, j)
    if truncated:  # zero mass on some tokens the draft still proposes
        p = p * (np.arange(len(p)) % 3 != 1)
        p = p / p.sum()
    return p


def sampled_batch(k: int, kind: str, seed: int = 0, truncated: bool = False):
    """N_DRAWS requests, each with k drafts; position j has target p_j and draft q_j."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.tensor(np.stack([target_p(j, truncated) for j in range(k + 1)]), dtype=torch.float32)
    q = torch.tensor(np.stack([np.roll(Q0, 2 * j) for j in range(k)]), dtype=torch.float32)
    # drafts ~ q_j; for one-hot (n-gram) the verifier is not told q, each draft is a point mass
    drafts = torch.stack([torch.multinomial(q[j], N_DRAWS, True, generator=gen) for j in range(k)], 1)
    draft_probs = q.repeat(N_DRAWS, 1) if kind == "draft_probs" else None  # [N_DRAWS * k, V]
    props = Proposals(
        draft_tokens=drafts.reshape(-1),
        cu_num_draft=torch.arange(N_DRAWS + 1) * k,
        draft_probs=draft_probs,
        num_draft=[k] * N_DRAWS,
    )
    target_probs = p.repeat(N_DRAWS, 1)  # [N_DRAWS * (k + 1), V]
    u_acc = torch.rand(N_DRAWS * k, generator=gen)
    u_res = torch.rand(N_DRAWS, generator=gen)
    return target_probs, props, u_acc, u_res


@pytest.mark.parametrize("truncated", [False, True])
@pytest.mark.parametrize("kind", ["draft_probs", "one_hot"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_sampled_first_token_follows_target(k, kind, truncated):
    target_probs, props, u_acc, u_res = sampled_batch(k, kind, seed=k, truncated=truncated)
    res = verify_sampled(target_probs, props, u_acc, u_res)
    first = res.output_tokens[:, 0].numpy()
    assert 0.05 < (res.num_accepted.numpy() == 0).mean() < 0.95  # both accept and reject exercised
    assert chi2_pvalue(np.bincount(first, minlength=len(P0)), target_p(0, truncated)) > 0.001


@pytest.mark.parametrize("kind", ["draft_probs", "one_hot"])
@pytest.mark.parametrize("k", [1, 2])
def test_sampled_second_token_given_first_accepted(k, kind):
    # k = 1: the second token is the bonus (from p_1); k = 2: accepted draft or recovered token
    target_probs, props, u_acc, u_res = sampled_batch(k, kind, seed=10 + k)
    res = verify_sampled(target_probs, props, u_acc, u_res)
    second = res.output_tokens[res.num_accepted >= 1, 1].numpy()
    assert len(second) > 10_000
    assert chi2_pvalue(np.bincount(second, minlength=len(P0)), target_p(1, False)) > 0.001


@pytest.mark.parametrize("kind", ["draft_probs", "one_hot"])
def test_broken_rules_fail_the_same_check(kind):
    target_probs, props, u_acc, u_res = sampled_batch(2, kind, seed=7)
    p0 = target_p(0, False)
    # always accept (u = 0 keeps every draft with p > 0): the first token follows q, not p
    res = verify_sampled(target_probs, props, torch.zeros_like(u_acc), u_res)
    assert chi2_pvalue(np.bincount(res.output_tokens[:, 0].numpy(), minlength=len(P0)), p0) < 0.001
    # resample from p instead of norm(max(0, p - q)) at a first-position rejection
    res = verify_sampled(target_probs, props, u_acc, u_res)
    rejected = res.num_accepted == 0
    from_p = sample_from_probs(target_probs[0:1].expand(N_DRAWS, -1), u_res)
    broken = torch.where(rejected, from_p, res.output_tokens[:, 0]).numpy()
    assert chi2_pvalue(np.bincount(broken, minlength=len(P0)), p0) < 0.001


def test_verify_sampled_hand_built():
    # rows: req0 (k=1) rows 0-1, req1 (k=0) row 2, req2 (k=1) rows 3-4, req3 (k=1) rows 5-6
    target = torch.tensor(
        [
            [0.2, 0.3, 0.5],  # req0 scores draft 2: p = 0.5
            [0.1, 0.1, 0.8],
            [0.0, 0.0, 1.0],  # req1 bonus
            [0.0, 1.0, 0.0],  # req2 scores draft 0: p = 0 -> always rejected
            [1.0, 0.0, 0.0],
            [0.2, 0.3, 0.5],  # req3 scores draft 2: p = 0.5
            [0.6, 0.3, 0.1],  # req3 bonus
        ]
    )
    props = Proposals.from_lists([[2], [], [0], [2]])
    u_acc, u_res = torch.tensor([0.9, 0.0, 0.4]), torch.tensor([0.3, 0.99, 0.3, 0.7])
    res = verify_sampled(target, props, u_acc, u_res)
    # req0: 0.9 >= 0.5 rejects; recovered from norm(max(0, p - onehot(2))) = [0.4, 0.6, 0]: u 0.3 -> 0
    # req1: bonus from [0, 0, 1] -> 2; req2: recovered from [0, 1, 0] -> 1
    # req3: 0.4 < 0.5 accepts 2; bonus from [0.6, 0.3, 0.1]: u 0.7 -> cdf [0.6, 0.9, 1.0] -> 1
    assert res.to_lists() == [[0], [2], [1], [2, 1]]
    assert res.match_bits() == ["0", "", "0", "1"]
    # with draft probs q: accept iff u * q(d) < p(d); q = p accepts even with u close to 1
    props.draft_probs = torch.tensor([[0.2, 0.3, 0.5], [0.5, 0.5, 0.0], [0.0, 0.2, 0.8]])
    res = verify_sampled(target, props, torch.tensor([0.999, 0.5, 0.7]), u_res)
    # req2: rejected, residual max(0, [0,1,0] - [0.5,0.5,0]) = [0, 0.5, 0] -> 1
    # req3: 0.7 * 0.8 = 0.56 >= 0.5 rejects; residual [0.2, 0.1, 0] / 0.3: u 0.7 -> cdf [.2, .3] -> 1
    assert res.to_lists() == [[2, 2], [2], [1], [1]]
    # req2 gets q == p at its row: rejected (u * q(0) = 0 is not < p(0) = 0), max(0, p - q) has no
    # mass, so the recovered token falls back to p
    props.draft_probs = torch.tensor([[0.2, 0.3, 0.5], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    res = verify_sampled(target, props, torch.tensor([0.0, 0.99, 0.0]), u_res)
    assert res.to_lists() == [[2, 2], [2], [1], [2, 1]]


def test_verify_sampled_rejects_bad_shapes():
    target_probs, props, u_acc, u_res = sampled_batch(1, "draft_probs")
    with pytest.raises(ValueError, match="uniforms_accept"):
        verify_sampled(target_probs, props, u_acc[:-1], u_res)
    with pytest.raises(ValueError, match="uniforms_resample"):
        verify_sampled(target_probs, props, u_acc, u_res[:-1])
    with pytest.raises(ValueError, match="target has"):
        verify_sampled(target_probs[:-1], props, u_acc, u_res)
    props.draft_probs = props.draft_probs[:, :3]
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampled(target_probs, props, u_acc, u_res)


# ---------------------------------------------------------------- verify(): mixed batches, seeds


def python_probs(logits: list[float], temperature: float, top_k: int) -> np.ndarray:
    x = [v / temperature for v in logits]
    kth = sorted(x, reverse=True)[top_k - 1]
    e = [math.exp(v) if v >= kth else 0.0 for v in x]
    return np.array(e) / sum(e)


def test_verify_end_to_end_distribution_with_temperature_and_top_k():
    vocab, k, num_req = 8, 2, 30_000
    gen = torch.Generator().manual_seed(3)
    target_row = torch.randn(k + 1, vocab, generator=gen)
    draft_row = torch.randn(k, vocab, generator=gen)
    sp = SamplingParams(temperature=0.7, top_k=5)
    q = logits_to_probs(draft_row, SamplingTensors.from_params([sp], [k]))  # same params as target
    drafts = torch.stack([torch.multinomial(q[j], num_req, True, generator=gen) for j in range(k)], 1)
    props = Proposals(drafts.reshape(-1), torch.arange(num_req + 1) * k, q.repeat(num_req, 1), [k] * num_req)
    torch.manual_seed(5)
    res = verify(target_row.repeat(num_req, 1), props, [sp] * num_req, [None] * num_req)
    p0 = python_probs(target_row[0].tolist(), 0.7, 5)
    assert chi2_pvalue(np.bincount(res.output_tokens[:, 0].numpy(), minlength=vocab), p0) > 0.001


def mixed_batch(seed: int = 0):
    rng = random.Random(seed)
    vocab = 9
    ks = [0, 8, 3, 0, 8, 5, 1, 8] * 3
    drafts = [[rng.randrange(vocab) for _ in range(k)] for k in ks]
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=torch.Generator().manual_seed(seed)) * 2
    sampling = [
        SamplingParams(temperature=0.0) if i % 3 == 0 else SamplingParams(temperature=1.0, top_p=0.9)
        for i in range(len(ks))
    ]
    return logits, Proposals.from_lists(drafts), sampling


def test_verify_mixed_batch_greedy_rows_follow_argmax():
    logits, props, sampling = mixed_batch()
    res = verify(logits, props, sampling, [None] * len(sampling))
    greedy = verify_greedy(logits, props).to_lists()
    got = res.to_lists()
    for i, sp in enumerate(sampling):
        if sp.is_greedy:
            assert got[i] == greedy[i]
    # with soft draft probs too (greedy rows must still follow the argmax whatever q is)
    props.draft_probs = torch.softmax(torch.randn(props.num_tokens, logits.shape[1]), -1)
    got = verify(logits, props, sampling, [None] * len(sampling)).to_lists()
    assert [g for g, sp in zip(got, sampling, strict=True) if sp.is_greedy] == [
        g for g, sp in zip(greedy, sampling, strict=True) if sp.is_greedy
    ]
    # all-greedy batch takes the greedy path
    assert (
        verify(logits, props, [SamplingParams()] * len(sampling), [None] * len(sampling)).to_lists() == greedy
    )


def test_verify_reproducible_with_seeded_generators():
    logits, props, sampling = mixed_batch(1)

    def run(seed_base: int) -> list[list[int]]:
        gens = [torch.Generator().manual_seed(seed_base + i) for i in range(len(sampling))]
        return verify(logits, props, sampling, gens).to_lists()

    assert run(100) == run(100)
    outs = {str(run(s)) for s in range(100, 110)}
    assert len(outs) > 1  # the seed matters
    torch.manual_seed(9)
    a = verify(logits, props, sampling, [None] * len(sampling)).to_lists()
    torch.manual_seed(9)
    assert verify(logits, props, sampling, [None] * len(sampling)).to_lists() == a


def test_verify_rejects_mismatched_lists():
    logits, props, sampling = mixed_batch()
    with pytest.raises(ValueError, match="sampling params"):
        verify(logits, props, sampling[:-1], [None] * len(sampling))
    with pytest.raises(ValueError, match="generators"):
        verify(logits, props, sampling, [None])
