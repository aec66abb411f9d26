"""What the cost models predict and read: a step's predicted ms per component (:class:`StepCost`), the
linearised marginal ms of a draft token (:class:`CostSlopes`), and a decode record's shape statistics
(:func:`record_stats`)."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from operator import mul as _mul

from specsched.engine.records import StepRecord
from specsched.policies.shapes import ShapeStats


@dataclass
class StepCost:
    """Predicted ms per component (floats, or arrays when predicted for many shapes at once)."""

    propose_ms: float
    score_ms: float
    verify_ms: float
    overhead_ms: float

    @property
    def total_ms(self) -> float:
        return self.propose_ms + self.score_ms + self.verify_ms + self.overhead_ms

    def as_dict(self) -> dict[str, float]:
        return {
            name: float(getattr(self, name))
            for name in ("propose_ms", "score_ms", "verify_ms", "overhead_ms")
        }


@dataclass
class CostSlopes:
    """Marginal ms of one more draft token, linearised (bucket padding ignored), for a search."""

    token_ms: float  # per draft token
    context_ms: float  # per draft token, per context token of its request
    spec_request_ms: float  # per drafting request, per unit of the batch's max k


def record_stats(record: StepRecord) -> ShapeStats:
    """:meth:`StepShape.stats` of a decode record's step (context as the policy sees it: the KV-cached
    tokens + the input token), in one pass of C-level sums over its requests."""
    ks = list(map(_k, record.requests))
    ctx = list(map(_context_len, record.requests))  # [B] KV-cached tokens: + 1 each below
    b, num_draft = len(ks), sum(ks)
    if min(ks) < 0 or min(ctx) < -1:
        raise ValueError("StepShape k and context_lens must be >= 0")
    num_context = sum(ctx) + b
    return ShapeStats(
        batch_size=b,
        num_tokens=num_draft + b,
        max_k=max(ks),
        num_spec_requests=b - ks.count(0),
        num_draft_tokens=num_draft,
        num_context_tokens=num_context,
        # Σ (k_i + 1)(c_i + 1) = Σ k_i c_i + Σ k_i + Σ (c_i + 1): integers, exact
        num_weighted_context_tokens=sum(map(_mul, ks, ctx)) + num_draft + num_context,
    )


_k, _context_len = attrgetter("k"), attrgetter("context_len")
