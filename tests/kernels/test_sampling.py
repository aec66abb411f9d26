"""logits_to_probs / sample_from_probs against plain-Python computations."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from specsched.engine.request import SamplingParams
from specsched.kernels.sampling import SamplingTensors, logits_to_probs, sample_from_probs


def chi2_sf(stat: float, df: int) -> float:
    try:
        from scipy.stats import chi2

        return float(chi2.sf(stat, df))
    except ImportError:  # regularized upper incomplete gamma Q(df/2, stat/2)
        a, x = torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        return float(torch.special.gammaincc(a, x))


def ref_probs(logits: list[float], sp: SamplingParams) -> list[float]:
    """Plain-Python temperature / top-k (by value, ties kept) / top-p / softmax."""
    if sp.is_greedy:
        best = max(range(len(logits)), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(len(logits))]
    x = [v / sp.temperature for v in logits]
    keep = set(range(len(x)))
    if 0 < sp.top_k < len(x):
        kth = sorted(x, reverse=True)[sp.top_k - 1]
        keep = {i for i in keep if x[i] >= kth}
    m = max(x[i] for i in keep)
    z = sum(math.exp(x[i] - m) for i in keep)
    p = {i: math.exp(x[i] - m) / z for i in keep}
    if sp.top_p < 1.0:
        order = sorted(keep, key=lambda i: -x[i])
        nucleus, mass = [], 0.0
        for i in order:
            nucleus.append(i)
            mass += p[i]
            if mass >= sp.top_p:
                break
        cut = min(x[i] for i in nucleus)
        keep = {i for i in keep if x[i] >= cut}
        z = sum(p[i] for i in keep)
        p = {i: p[i] / z for i in keep}
    return [p.get(i, 0.0) for i in range(len(x))]


def probs_for(logits: list[list[float]], params: list[SamplingParams]) -> torch.Tensor:
    return logits_to_probs(torch.tensor(logits), SamplingTensors.from_params(params))


def test_chi2_sf_known_values():
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-5)
    assert chi2_sf(11.070498, 5) == pytest.approx(0.05, abs=1e-5)
    assert chi2_sf(4.0, 2) == pytest.approx(math.exp(-2.0), rel=1e-9)


def test_from_params_repeats_rows():
    a = SamplingParams(temperature=0.5, top_k=3, top_p=0.9)
    b = SamplingParams()
    st = SamplingTensors.from_params([a, b], repeats=[2, 3])
    assert st.temperature.tolist() == pytest.approx([0.5, 0.5, 0, 0, 0])
    assert st.top_k.tolist() == [3, 3, 0, 0, 0]
    assert st.top_p.tolist() == pytest.approx([0.9, 0.9, 1, 1, 1])
    assert st.is_greedy.tolist() == [False, False, True, True, True]
    assert st.temperature.dtype == torch.float32 and st.top_k.dtype == torch.int64
    with pytest.raises(ValueError, match="repeats"):
        SamplingTensors.from_params([a, b], repeats=[1])
    with pytest.raises(ValueError, match="repeats"):
        SamplingTensors.from_params([a], repeats=[-1])


LOG4 = [math.log(v) for v in (0.1, 0.2, 0.3, 0.4)]


@pytest.mark.parametrize(
    "sp, expected",
    [
        (SamplingParams(temperature=1.0), [0.1, 0.2, 0.3, 0.4]),
        (SamplingParams(temperature=1.0, top_p=0.35), [0, 0, 0, 1]),
        (SamplingParams(temperature=1.0, top_p=0.5), [0, 0, 3 / 7, 4 / 7]),
        (SamplingParams(temperature=1.0, top_p=0.75), [0, 2 / 9, 3 / 9, 4 / 9]),
        (SamplingParams(temperature=1.0, top_k=2), [0, 0, 3 / 7, 4 / 7]),
        (SamplingParams(temperature=1.0, top_k=2, top_p=0.5), [0, 0, 0, 1]),  # 4/7 >= 0.5
        (SamplingParams(temperature=1.0, top_k=9), [0.1, 0.2, 0.3, 0.4]),  # k > vocab: off
        (SamplingParams(temperature=0.5), [0.01 / 0.3, 0.04 / 0.3, 0.09 / 0.3, 0.16 / 0.3]),
        (SamplingParams(temperature=0.0, top_k=2), [0, 0, 0, 1]),
    ],
)
def test_logits_to_probs_hand_built(sp, expected):
    probs = probs_for([LOG4], [sp])
    assert probs.dtype == torch.float32
    assert probs[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_top_k_keeps_ties_and_greedy_is_one_hot():
    probs = probs_for(
        [[1.0, 1.0, 0.0, 2.0], [0.0, 3.0, 3.0, -1e9]],
        [
            SamplingParams(temperature=1.0, top_k=2),
            SamplingParams(temperature=0.0),
        ],
    )
    e = math.e
    assert probs[0].tolist() == pytest.approx(
        [e / (2 * e + e * e), e / (2 * e + e * e), 0, e * e / (2 * e + e * e)]
    )
    assert probs[1].tolist() == [0.0, 1.0, 0.0, 0.0]  # argmax takes the first of tied maxima


def test_logits_to_probs_matches_python_on_random_mixed_batch():
    rng = random.Random(0)
    vocab = 11
    logits, params = [], []
    for _ in range(60):
        logits.append([rng.gauss(0, 2) for _ in range(vocab)])
        params.append(
            SamplingParams(
                temperature=rng.choice([0.0, 0.3, 1.0, 1.7]),
                top_k=rng.choice([0, 1, 3, 7, 11, 20]),
                top_p=rng.choice([1.0, 0.95, 0.6, 0.2, 0.01]),
            )
        )
    got = probs_for(logits, params)  # one vectorised call with every row's own params
    for row, lg, sp in zip(got.tolist(), logits, params, strict=True):
        assert row == pytest.approx(ref_probs(lg, sp), abs=1e-5), sp
    assert torch.allclose(got.sum(-1), torch.ones(len(logits)), atol=1e-5)


def test_logits_to_probs_rejects_bad_shapes():
    st = SamplingTensors.from_params([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="rows"):
        logits_to_probs(torch.zeros(3, 5), st)
    with pytest.raises(ValueError, match=r"\[num_rows, vocab\]"):
        logits_to_probs(torch.zeros(2, 5, 1), st)


def test_sample_from_probs_hand_built():
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]] * 6 + [[0.5, 0.5, 0.0, 0.0], [2.0, 0.0, 2.0, 0.0]])
    u = torch.tensor([0.0, 0.1, 0.2, 0.69, 0.7, 0.999, 1.0, 0.5])
    # cdf [0.2, 0.2, 0.7, 1.0]: first index whose cdf exceeds u; zero-prob token 1 never chosen;
    # u == 1 clamps to the last nonzero token; unnormalised rows are scaled by their sum
    assert sample_from_probs(probs, u).tolist() == [0, 0, 2, 2, 3, 3, 1, 2]


def test_sample_from_probs_distribution():
    p = np.array([0.05, 0.0, 0.3, 0.15, 0.25, 0.0, 0.25])
    n = 100_000
    gen = torch.Generator().manual_seed(1234)
    probs = torch.tensor(p, dtype=torch.float32).expand(n, -1).contiguous()
    tokens = sample_from_probs(probs, torch.rand(n, generator=gen))
    counts = np.bincount(tokens.numpy(), minlength=len(p))
    assert counts[p == 0].sum() == 0
    exp = n * p[p > 0]
    stat = float(((counts[p > 0] - exp) ** 2 / exp).sum())
    assert chi2_sf(stat, int((p > 0).sum()) - 1) > 0.001


def test_sample_from_probs_rejects_bad_shapes():
    with pytest.raises(ValueError, match="uniforms"):
        sample_from_probs(torch.ones(3, 4), torch.zeros(2))
