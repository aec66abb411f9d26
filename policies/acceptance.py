"""Acceptance estimates: expected emitted tokens, per-request Beta posteriors, per-proposer priors.

Terms: a draft token is *accepted* when the verifier keeps it; the per-token acceptance rate ``a``
is the probability that a draft token is accepted given that every draft before it was. One step
with ``k`` drafts of which ``num_accepted`` were accepted emits ``num_accepted + 1`` tokens.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

DEFAULT_PRIORS: dict[str, tuple[float, float]] = {
    "ngram": (1.0, 2.0),  # prompt lookup: often wrong, mean 1/3
    "draft": (2.0, 2.0),  # a draft model: mean 1/2
    "synthetic": (2.0, 2.0),
}


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens emitted by one step that scores ``k`` proposals with acceptance rate ``a``.

    Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding"
    (ICML; the expected number of generated tokens per iteration, Eq. 1): with i.i.d. per-token
    acceptance ``a`` and ``k`` (their gamma) proposals, the step emits the accepted prefix plus one
    target token, in expectation ``(1 - a^(k+1)) / (1 - a)`` tokens; ``k + 1`` in the limit a -> 1,
    and 1 for k = 0 (plain decoding).
    """
    if not 0.0 <= a <= 1.0 or math.isnan(a):
        raise ValueError(f"acceptance rate must be in [0, 1], got {a}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if 1.0 - a < 1e-9:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def beta_std(alpha: float, beta: float) -> float:
    """Standard deviation of Beta(alpha, beta)."""
    n = alpha + beta
    return math.sqrt(alpha * beta / (n * n * (n + 1.0)))


@dataclass
class AcceptanceConfig:
    priors: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_PRIORS))
    default_prior: tuple[float, float] = (1.0, 1.0)  # for proposers not in ``priors``
    aggregate_decay: float = 0.995  # per observation, on the per-proposer aggregate counts
    prior_strength: float = 8.0  # pseudo-observations the pool lends while it is too young to tell
    max_prior_strength: float = 64.0  # ... at most, however alike the pool's requests are
    pool_requests: int = 64  # finished requests (plus the running ones) the prior strength is fitted on
    min_pool_requests: int = 4  # fewer requests with evidence: ``prior_strength``
    request_decay: float = 1.0  # per observation, on a request's own counts (1 = no forgetting)

    def __post_init__(self) -> None:
        for name, (alpha, beta) in {**self.priors, "default": self.default_prior}.items():
            if not (alpha > 0 and beta > 0):
                raise ValueError(
                    f"acceptance prior for {name!r} needs alpha, beta > 0, got ({alpha}, {beta})"
                )
        for name in ("aggregate_decay", "request_decay"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"acceptance.{name} must be in (0, 1], got {value}")
        if not 0 < self.prior_strength <= self.max_prior_strength:
            raise ValueError(
                f"acceptance: need 0 < prior_strength <= max_prior_strength, got {self.prior_strength}"
                f" and {self.max_prior_strength}"
            )
        if self.pool_requests < 1 or self.min_pool_requests < 2:
            raise ValueError(
                f"acceptance: pool_requests must be >= 1 and min_pool_requests >= 2, got "
                f"{self.pool_requests} and {self.min_pool_requests}"
            )


def pool_strength(counts: list[tuple[float, float]]) -> float | None:
    """Prior strength α + β of the Beta that the requests' acceptance rates are drawn from, by the
    method of moments (empirical Bayes), or None when the counts cannot tell.

    Request i saw s_i accepted and f_i rejected drafts (n_i = s_i + f_i Bernoulli trials, rate
    p_i = s_i / n_i). Under a ~ Beta(α, β) per request (the beta-binomial model), with p̄ = Σ s_i / Σ n_i,
    N = Σ n_i and R requests, the weighted spread has expectation
    E[Σ n_i (p_i − p̄)²] ≈ p̄(1 − p̄)(R − 1) + τ² (N − Σ n_i² / N): binomial noise plus the
    between-request variance τ² (Kleinman 1973, "Proportions with extraneous variance: single and
    independent samples", JASA 68, eq. 2.3). Solving for τ² and matching the Beta's variance
    p̄(1 − p̄) / (α + β + 1) = τ² gives α + β = p̄(1 − p̄) / τ² − 1; τ² <= 0 (the requests differ no
    more than chance) gives +inf. Requests with no trials are skipped; None for fewer than two.
    """
    sums = PoolSums()
    for s, f in counts:
        sums.add(s, f, 1.0)
    return sums.strength()


class PoolSums:
    """The sums :func:`pool_strength` needs over a pool of (successes, failures) counts — R (requests
    with trials), Σ n_i, Σ s_i, Σ s_i² / n_i, Σ n_i² — kept as counts come and go, so the strength
    of a pool whose requests all moved is O(1) instead of a pass over the pool."""

    __slots__ = ("num", "total", "succ", "sq", "nsq", "num_updates")

    def __init__(self) -> None:
        self.num = 0
        self.total = self.succ = self.sq = self.nsq = 0.0
        self.num_updates = 0  # adds and removes since the sums were last summed from scratch

    def add(self, s: float, f: float, sign: float) -> None:
        """Add (``sign`` 1) or remove (-1) one request's counts; no trials: nothing."""
        n = s + f
        if n > 0:
            self.num += 1 if sign > 0 else -1
            self.total += sign * n
            self.succ += sign * s
            self.sq += sign * (s * s / n)
            self.nsq += sign * (n * n)
            self.num_updates += 1
            if self.num == 0:  # an empty pool: exact zeros, not the rounding of what came and went
                self.total = self.succ = self.sq = self.nsq = 0.0

    def strength(self) -> float | None:
        """:func:`pool_strength` of the counts summed here."""
        if self.num < 2:
            return None
        total = self.total
        p = self.succ / total
        spread = self.sq - p * p * total  # Σ n_i (p_i − p̄)²
        denom = total - self.nsq / total
        if denom <= 0 or p <= 0.0 or p >= 1.0:
            return None
        tau2 = (spread - p * (1.0 - p) * (self.num - 1)) / denom
        return math.inf if tau2 <= 0 else max(p * (1.0 - p) / tau2 - 1.0, 0.0)


# adds and removes after which a pool's sums are summed again from its counts (bounds the rounding
# that removing counts from running float sums leaves behind)
_RESUM_UPDATES = 1 << 13


class ObservationSink(Protocol):
    """What else hears an estimator's observations (:attr:`AcceptanceEstimator.stages`)."""

    def observe(self, request_id: str, proposer: str, k: int, num_accepted: int) -> None: ...

    def forget(self, request_id: str) -> None: ...


class AcceptanceEstimator:
    """Beta(alpha, beta) posterior over each request's acceptance rate.

    One step is a truncated-geometric observation: ``num_accepted`` successes, then one failure
    unless all ``k`` drafts were accepted (the walk stopped at k, not at a rejection). The Beta is
    conjugate to each Bernoulli trial, so the update is counting. A request's posterior is its own
    counts on top of a prior that is its proposer's base prior moved towards the proposer's
    (decayed) aggregate over all *other* observations, current at every lookup — requests running
    side by side share what they see (partial pooling, a hierarchical Beta). The prior's weight (its
    strength, in pseudo-observations) is estimated from the pool — the proposer's running requests
    and its last ``pool_requests`` finished ones — by :func:`pool_strength`: requests that are alike
    lend a young request a strong prior (up to ``max_prior_strength``), requests that differ a weak
    one, and a pool of fewer than ``min_pool_requests`` requests lends ``prior_strength``. Either way
    a request's own counts add to it, so they dominate as they grow (Efron & Morris 1975, "Data
    analysis using Stein's estimator and its generalizations", JASA 70: shrinkage by the ratio of
    within- to between-request variance).

    Cost (the engine looks up every running request's posterior every step): the pool's sums are
    kept as counts change (:class:`PoolSums`), and each proposer's prior terms are computed once
    after a change, so a lookup is a few float operations.
    """

    def __init__(self, config: AcceptanceConfig | None = None) -> None:
        self.config = config or AcceptanceConfig()
        self._requests: dict[str, list[float]] = {}  # request_id -> its own [successes, failures]
        self._aggregate: dict[str, list[float]] = {}  # proposer -> [successes, failures] (decayed)
        self._proposer_of: dict[str, str] = {}  # request_id -> the proposer it was observed under
        self._finished: dict[str, deque] = {}  # proposer -> (successes, failures) of finished requests
        self._pools: dict[str, PoolSums] = {}  # proposer -> sums over its finished and running counts
        # proposer -> (alpha0, beta0, aggregate successes, failures, strength cap), until it changes
        self._priors: dict[str, tuple[float, float, float, float, float]] = {}
        # also told every observation and forget: the two-rate model of a policy that asks for it
        # (policies/acceptance_stages.py stages_of); None: nobody
        self.stages: ObservationSink | None = None

    def _base_prior(self, proposer: str) -> tuple[float, float]:
        return self.config.priors.get(proposer, self.config.default_prior)

    def _pool(self, proposer: str) -> PoolSums:
        pool = self._pools.get(proposer)
        if pool is None:
            pool = self._pools[proposer] = PoolSums()
        return pool

    def prior_strength(self, proposer: str) -> float:
        """Pseudo-observations the pool of ``proposer`` lends a request's prior (see class)."""
        cfg = self.config
        pool = self._pools.get(proposer)
        if pool is not None and pool.num_updates >= _RESUM_UPDATES:  # sum afresh, as pool_strength
            pool = self._pools[proposer] = PoolSums()
            for s, f in self._finished.get(proposer, ()):
                pool.add(s, f, 1.0)
            for r, c in self._requests.items():
                if self._proposer_of[r] == proposer:
                    pool.add(c[0], c[1], 1.0)
            pool.num_updates = 0
        fitted = pool.strength() if pool is not None and pool.num >= cfg.min_pool_requests else None
        return cfg.prior_strength if fitted is None else min(fitted, cfg.max_prior_strength)

    def _prior_terms(self, proposer: str) -> tuple[float, float, float, float, float]:
        found = self._priors.get(proposer)
        if found is None:
            alpha0, beta0 = self._base_prior(proposer)
            s, f = self._aggregate.get(proposer, (0.0, 0.0))
            cap = max(self.prior_strength(proposer), alpha0 + beta0)
            found = self._priors[proposer] = (alpha0, beta0, s, f, cap)
        return found

    def prior(self, proposer: str, own: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
        """The Beta prior of a request of ``proposer`` whose own counts ``own`` are left out of the
        aggregate (a new request: none)."""
        alpha0, beta0, s, f, cap = self._prior_terms(proposer)
        s, f = max(s - own[0], 0.0), max(f - own[1], 0.0)
        alpha, beta = alpha0 + s, beta0 + f
        strength = alpha + beta
        if strength > cap:
            alpha, beta = alpha * cap / strength, beta * cap / strength
        return alpha, beta

    def observe(self, request_id: str, proposer: str, k: int, num_accepted: int) -> None:
        """Update from one step of ``request_id``: ``k`` drafts scored, ``num_accepted`` accepted."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if not 0 <= num_accepted <= k:
            raise ValueError(f"num_accepted must be in [0, k={k}], got {num_accepted}")
        if k == 0:
            return
        if self.stages is not None:
            self.stages.observe(request_id, proposer, k, num_accepted)
        failures = 1.0 if num_accepted < k else 0.0
        cfg = self.config
        own = self._requests.get(request_id)
        if own is None:
            own = self._requests[request_id] = [num_accepted + 0.0, failures]
            self._proposer_of[request_id] = proposer
            self._pool(proposer).add(own[0], failures, 1.0)
        else:
            s0, f0 = own
            decay = cfg.request_decay
            s1, f1 = s0 * decay + num_accepted, f0 * decay + failures
            own[0], own[1] = s1, f1
            before = self._proposer_of[request_id]
            if before == proposer:  # the pool's sums move by the difference (n0, n1 >= 1)
                pool = self._pools[proposer]
                n0, n1 = s0 + f0, s1 + f1
                pool.total += n1 - n0
                pool.succ += s1 - s0
                pool.sq += s1 * s1 / n1 - s0 * s0 / n0
                pool.nsq += n1 * n1 - n0 * n0
                pool.num_updates += 1
            else:  # its counts move to the other proposer's pool
                self._pool(before).add(s0, f0, -1.0)
                self._pool(proposer).add(s1, f1, 1.0)
                self._proposer_of[request_id] = proposer
                self._priors.pop(before, None)
        self._priors.pop(proposer, None)
        agg = self._aggregate.get(proposer)
        if agg is None:
            agg = self._aggregate[proposer] = [0.0, 0.0]
        decay = cfg.aggregate_decay
        agg[0] = agg[0] * decay + num_accepted
        agg[1] = agg[1] * decay + failures

    def posterior(self, request_id: str, proposer: str) -> tuple[float, float]:
        """(alpha, beta) of the request's posterior (its proposer's prior when never observed)."""
        own = self._requests.get(request_id)
        if own is None:
            return self.prior(proposer)
        alpha, beta = self.prior(proposer, own)
        return alpha + own[0], beta + own[1]

    def mean(self, request_id: str, proposer: str) -> float:
        alpha, beta = self.posterior(request_id, proposer)
        return alpha / (alpha + beta)

    def std(self, request_id: str, proposer: str) -> float:
        return beta_std(*self.posterior(request_id, proposer))

    def mean_std(self, request_id: str, proposer: str) -> tuple[float, float]:
        """(:meth:`mean`, :meth:`std`) from one posterior lookup (:meth:`posterior` and
        :func:`beta_std`, inlined: the engine calls this for every running request every step)."""
        terms = self._priors.get(proposer)
        terms = terms if terms is not None else self._prior_terms(proposer)
        return _posterior_mean_std(*terms, *self._requests.get(request_id, ()))

    def mean_std_many(self, request_ids: Iterable[str], proposer: str) -> list[tuple[float, float]]:
        """:meth:`mean_std` of each of ``request_ids`` (all of ``proposer``), the prior's terms looked
        up once and the never-observed requests' estimate computed once (the engine's view of a batch
        of one proposer)."""
        terms = self._priors.get(proposer)
        terms = terms if terms is not None else self._prior_terms(proposer)
        fresh = _posterior_mean_std(*terms)
        get = self._requests.get
        return [
            fresh if (own := get(rid)) is None else _posterior_mean_std(*terms, *own) for rid in request_ids
        ]

    def aggregate_mean(self, proposer: str) -> float:
        """Mean acceptance of the prior a new request of ``proposer`` would get now."""
        alpha, beta = self.prior(proposer)
        return alpha / (alpha + beta)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's counts (its steps stay in the proposer aggregate, and its counts
        in the pool the prior strength is fitted on)."""
        if self.stages is not None:
            self.stages.forget(request_id)
        own = self._requests.pop(request_id, None)
        if own is None:
            return
        proposer = self._proposer_of.pop(request_id)
        finished = self._finished.get(proposer)
        if finished is None:
            finished = self._finished[proposer] = deque(maxlen=self.config.pool_requests)
        if len(finished) == finished.maxlen:  # the oldest finished request leaves the pool
            self._pool(proposer).add(*finished[0], -1.0)
        finished.append((own[0], own[1]))  # its counts stay in the pool, now as a finished request
        self._priors.pop(proposer, None)

    @property
    def num_requests(self) -> int:
        return len(self._requests)


_sqrt = math.sqrt


def _posterior_mean_std(
    alpha0: float, beta0: float, s: float, f: float, cap: float, own_s: float = 0.0, own_f: float = 0.0
) -> tuple[float, float]:
    """Mean and std of a request's posterior: the prior ``(alpha0, beta0)`` plus the proposer's
    aggregate successes / failures ``(s, f)`` with the request's own ``(own_s, own_f)`` left out
    (clipped at 0), its strength capped at ``cap``, then the request's own counts added
    (:meth:`AcceptanceEstimator.posterior` and :func:`beta_std`, as plain arithmetic)."""
    s, f = s - own_s, f - own_f
    alpha, beta = alpha0 + (s if s > 0.0 else 0.0), beta0 + (f if f > 0.0 else 0.0)
    strength = alpha + beta
    if strength > cap:
        alpha, beta = alpha * cap / strength, beta * cap / strength
    alpha, beta = alpha + own_s, beta + own_f
    n = alpha + beta
    return alpha / n, _sqrt(alpha * beta / (n * n * (n + 1.0)))
