"""Two acceptance rates per request: the first draft's, and a later draft's given the one before.

A draft j is accepted only if drafts 1..j-1 were; Leviathan et al. (2023) take every draft to be
accepted with one rate a, so draft j survives with probability a^j. A prompt-lookup (n-gram) draft
is a copied span: its first token is a coin flip, and once it holds the span mostly does (H100
serve logs, 2026-12-05: draft 1 accepted 0.51 of the time, drafts 2..8 given their predecessor
0.82-0.95), so one rate fitted to its steps overvalues its first draft (0.77) and undervalues its
last ones. Here draft j survives with a1 · a2^(j-1):

- a1, the *first* rate: each step with k >= 1 drafts is one trial, a success when draft 1 was
  accepted;
- a2, the *continuation* rate: each later draft reached (its predecessor accepted) is one trial, a
  success when it was accepted — a truncated-geometric observation of ``num_accepted - 1``
  successes out of ``k - 1`` drafts, as :class:`~specsched.policies.acceptance.AcceptanceEstimator`
  counts a single rate.

Each rate is an :class:`~specsched.policies.acceptance.AcceptanceEstimator` of its own (per-request
Beta posteriors over a pooled per-proposer prior). With a1 = a2 (i.i.d. drafts, the synthetic
proposer) the survival is the single-rate model's a^j. The counts are folded in when read (the
policy's decide, on CUDA while the GPU scores), not when observed: the engine's commit, on the
step's critical path, only appends.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from specsched.policies.acceptance import AcceptanceConfig, AcceptanceEstimator


def stages_of(estimator: AcceptanceEstimator) -> StagedAcceptance:
    """The two-rate model fed by ``estimator`` (its ``stages``), made on first use: it counts the
    observations from then on."""
    found = estimator.stages
    if not isinstance(found, StagedAcceptance):
        found = estimator.stages = StagedAcceptance(estimator.config)
    return found


class StagedAcceptance:
    """The two posteriors of every request (module docstring), fed by a single-rate estimator
    (:func:`stages_of`)."""

    def __init__(self, config: AcceptanceConfig | None = None) -> None:
        self.first = AcceptanceEstimator(config)
        self.rest = AcceptanceEstimator(config)
        self.pending: list[tuple[str, str | None, int, int]] = []  # (request, proposer, k, accepted)

    def observe(self, request_id: str, proposer: str, k: int, num_accepted: int) -> None:
        self.pending.append((request_id, proposer, k, num_accepted))

    def forget(self, request_id: str) -> None:
        self.pending.append((request_id, None, -1, -1))

    def flush(self) -> None:
        """Fold the pending observations and forgets into the two estimators, in order."""
        first, rest = self.first, self.rest
        for rid, proposer, k, n in self.pending:
            if proposer is None:
                first.forget(rid)
                rest.forget(rid)
                continue
            first.observe(rid, proposer, 1, 1 if n else 0)
            if n and k > 1:
                rest.observe(rid, proposer, k - 1, n - 1)
        self.pending.clear()

    def mean_std(self, request_id: str, proposer: str) -> tuple[float, float, float, float]:
        """:meth:`mean_std_many` of one request, as floats."""
        self.flush()
        m1, s1 = self.first.mean_std(request_id, proposer)
        m2, s2 = self.rest.mean_std(request_id, proposer)
        return m1, s1, m2, s2

    def mean_std_many(
        self, request_ids: Iterable[str], proposer: str
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Posterior mean and sd of a1 and of a2 ``[B]`` each, for ``request_ids`` (all of
        ``proposer``)."""
        self.flush()
        ids = list(request_ids)
        m1, s1 = np.array(self.first.mean_std_many(ids, proposer), dtype=np.float64).reshape(-1, 2).T
        m2, s2 = np.array(self.rest.mean_std_many(ids, proposer), dtype=np.float64).reshape(-1, 2).T
        return m1, s1, m2, s2


def staged_rows(
    stages: StagedAcceptance, request_ids: list[str], proposer: str, num: int
) -> list[list[float]]:
    """:func:`staged_powers` of :meth:`StagedAcceptance.mean_std_many`, bit for bit, as Python lists
    (goodput's small-batch search, policies/goodput_small.py, where numpy's per-call overhead is the
    time): one :func:`staged_survival` row per request."""
    stages.flush()
    firsts = stages.first.mean_std_many(request_ids, proposer)
    rests = stages.rest.mean_std_many(request_ids, proposer)
    return [staged_survival(m1, m2, s2, num) for (m1, _), (m2, s2) in zip(firsts, rests)]


def staged_survival(first_mean: float, rest_mean: float, rest_std: float, num: int) -> list[float]:
    """One request's row of :func:`staged_powers` in plain Python, bit for bit (draft 1's survival a1,
    then E[a2^(j-1)] times a1: the same products in the same order), for batches where numpy's
    per-call overhead is most of goodput's decide with two rates (batch 1: 0.30 against 0.12 ms on
    the dev CPU)."""
    m = min(max(rest_mean, 0.0), 1.0)
    strength = min(max(m * (1.0 - m) / max(rest_std * rest_std, 1e-300) - 1.0, 1.0), 1e9)  # alpha + beta
    a1 = min(max(first_mean, 0.0), 1.0)
    out, pw, base = [a1], 1.0, m * strength
    for j in range(num - 1):
        pw *= (base + j) / (strength + j)
        out.append(pw * a1)
    return out


def staged_powers(
    first_mean: np.ndarray, rest_mean: np.ndarray, rest_std: np.ndarray, num: int
) -> np.ndarray:
    """``[B, num]`` survival of drafts 1..num: E[a1] · E[a2^(j-1)] (the two posteriors taken
    independent; E[a2^m] under a2's Beta, as
    :func:`~specsched.policies.goodput_search.acceptance_powers`)."""
    from specsched.policies.goodput_search import acceptance_powers

    out = np.empty((len(first_mean), num))
    out[:, 0] = 1.0
    if num > 1:
        out[:, 1:] = acceptance_powers(rest_mean, rest_std, num - 1)
    out *= np.minimum(np.maximum(first_mean, 0.0), 1.0)[:, None]
    return out
