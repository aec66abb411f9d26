"""Acceptance estimates: expected emitted tokens, per-request Beta posteriors, per-proposer priors.

Terms: a draft token is *accepted* when the verifier keeps it; the per-token acceptance rate ``a``
is the probability that a draft token is accepted given that every draft before it was. One step
with ``k`` drafts of which ``num_accepted`` were accepted emits ``num_accepted + 1`` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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
    max_prior_strength: float = 8.0  # pseudo-observations the aggregate may lend a new request
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
        if self.max_prior_strength <= 0:
            raise ValueError(f"acceptance.max_prior_strength must be > 0, got {self.max_prior_strength}")


class AcceptanceEstimator:
    """Beta(alpha, beta) posterior over each request's acceptance rate.

    One step is a truncated-geometric observation: ``num_accepted`` successes, then one failure
    unless all ``k`` drafts were accepted (the walk stopped at k, not at a rejection). The Beta is
    conjugate to each Bernoulli trial, so the update is counting. A request's posterior is its own
    counts on top of a prior that is its proposer's base prior moved towards the proposer's
    (decayed) aggregate over all *other* observations, current at every lookup — requests running
    side by side share what they see (partial pooling) — with the aggregate's weight capped at
    ``max_prior_strength`` pseudo-observations, so a request's own steps soon dominate.
    """

    def __init__(self, config: AcceptanceConfig | None = None) -> None:
        self.config = config or AcceptanceConfig()
        self._requests: dict[str, list[float]] = {}  # request_id -> its own [successes, failures]
        self._aggregate: dict[str, list[float]] = {}  # proposer -> [successes, failures] (decayed)

    def _base_prior(self, proposer: str) -> tuple[float, float]:
        return self.config.priors.get(proposer, self.config.default_prior)

    def prior(self, proposer: str, own: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
        """The Beta prior of a request of ``proposer`` whose own counts ``own`` are left out of the
        aggregate (a new request: none)."""
        alpha0, beta0 = self._base_prior(proposer)
        s, f = self._aggregate.get(proposer, (0.0, 0.0))
        s, f = max(s - own[0], 0.0), max(f - own[1], 0.0)
        alpha, beta = alpha0 + s, beta0 + f
        strength = alpha + beta
        cap = max(self.config.max_prior_strength, alpha0 + beta0)
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
        failures = 1.0 if num_accepted < k else 0.0
        own = self._requests.setdefault(request_id, [0.0, 0.0])
        decay = self.config.request_decay
        own[0] = own[0] * decay + num_accepted
        own[1] = own[1] * decay + failures
        agg = self._aggregate.setdefault(proposer, [0.0, 0.0])
        agg[0] = agg[0] * self.config.aggregate_decay + num_accepted
        agg[1] = agg[1] * self.config.aggregate_decay + failures

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
        """(:meth:`mean`, :meth:`std`) from one posterior lookup."""
        alpha, beta = self.posterior(request_id, proposer)
        return alpha / (alpha + beta), beta_std(alpha, beta)

    def aggregate_mean(self, proposer: str) -> float:
        """Mean acceptance of the prior a new request of ``proposer`` would get now."""
        alpha, beta = self.prior(proposer)
        return alpha / (alpha + beta)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's counts (its steps stay in the proposer aggregate)."""
        self._requests.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._requests)
