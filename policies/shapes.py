"""Step shapes and the cost models' features computed from them.

Features per component (ms coefficients; context counts in thousands of tokens so all features are
of similar magnitude):

- score: ``[1, rows_padded, tokens_padded, Σ ctx_i / 1e3, Σ (k_i+1)·ctx_i / 1e3, is_eager]``.
  rows = Σ(k_i+1) for batch expansion (one single-query row per token), = batch size for MQA.
  ``Σ ctx_i`` is reading each prefix once (MQA), ``Σ (k_i+1)·ctx_i`` reading it once per row (batch
  expansion) or the q·K work of k_i+1 queries (MQA). Graph scorers (``graph_buckets``) pad rows and
  tokens up to the next captured bucket; a shape above the largest bucket runs eagerly: no padding
  and ``is_eager = 1`` (the launch overhead the graph saved).
- propose: ``[1, max_k, max_k · num_spec_requests, num_draft_tokens]`` (a draft model runs max_k
  sequential forwards over the requests that draft; n-gram is about constant); 0 when max_k = 0.
- verify: ``[1, num_tokens]``; overhead (step total minus the three above): ``[1, batch_size]``.

Every feature builder takes a :class:`ShapeStats` whose fields are ints, or numpy arrays of one
shape (then the features are arrays too: many candidate shapes at once).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from operator import mul

import numpy as np

__all__ = [
    "EXPANSION_SCORERS",
    "FEATURES",
    "ShapeStats",
    "StepShape",
    "overhead_features",
    "pad_to_bucket",
    "propose_features",
    "score_features",
    "shape_stats",
    "verify_features",
]

FEATURES: dict[str, list[str]] = {
    "score": ["bias", "rows_padded", "tokens_padded", "context_ktokens", "row_context_ktokens", "is_eager"],
    "propose": ["bias", "max_k", "max_k_x_spec_requests", "draft_tokens"],
    "verify": ["bias", "tokens"],
    "overhead": ["bias", "batch_size"],
}
EXPANSION_SCORERS = ("batch_expansion",)  # scorers with one row per scored token


@dataclass
class ShapeStats:
    """The aggregates of a step shape that the features use. Fields are ints, or numpy arrays of
    equal shape when many candidate shapes are predicted at once (the goodput search)."""

    batch_size: int
    num_tokens: int  # Σ (k_i + 1)
    max_k: int
    num_spec_requests: int  # requests with k_i > 0
    num_draft_tokens: int  # Σ k_i
    num_context_tokens: int  # Σ ctx_i
    num_weighted_context_tokens: int  # Σ (k_i + 1) · ctx_i


@dataclass
class StepShape:
    """One decode step's shape: per request k (drafts scored) and context length (KV-cached tokens
    plus the step's input token, as ``RequestView.context_len``)."""

    k: list[int]  # [B]
    context_lens: list[int]  # [B]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.context_lens):
            raise ValueError(
                f"StepShape needs one k per context length, got {len(self.k)} vs {len(self.context_lens)}"
            )
        if any(k < 0 for k in self.k) or any(c < 0 for c in self.context_lens):
            raise ValueError("StepShape k and context_lens must be >= 0")

    @property
    def batch_size(self) -> int:
        return len(self.k)

    @property
    def num_tokens(self) -> int:
        return sum(self.k) + len(self.k)

    @property
    def max_k(self) -> int:
        return max(self.k, default=0)

    @property
    def num_context_tokens(self) -> int:
        return sum(self.context_lens)

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.k)

    def stats(self) -> ShapeStats:
        return ShapeStats(
            batch_size=self.batch_size,
            num_tokens=self.num_tokens,
            max_k=self.max_k,
            num_spec_requests=sum(1 for k in self.k if k > 0),
            num_draft_tokens=self.num_draft_tokens,
            num_context_tokens=self.num_context_tokens,
            num_weighted_context_tokens=sum(
                (k + 1) * c for k, c in zip(self.k, self.context_lens, strict=True)
            ),
        )


def shape_stats(k: list[int], context_lens: list[int]) -> ShapeStats:
    """``StepShape(k, context_lens).stats()`` in one pass of C-level sums over the lists (the fixed
    policies predict one shape per step: no StepShape, its checks folded into two ``min`` calls)."""
    b = len(k)
    if len(context_lens) != b:
        raise ValueError(f"StepShape needs one k per context length, got {b} vs {len(context_lens)}")
    if b and (min(k) < 0 or min(context_lens) < 0):
        raise ValueError("StepShape k and context_lens must be >= 0")
    num_draft, num_context = sum(k), sum(context_lens)
    return ShapeStats(
        batch_size=b,
        num_tokens=num_draft + b,
        max_k=max(k, default=0),
        num_spec_requests=b - k.count(0),  # k >= 0: k > 0 is k != 0
        num_draft_tokens=num_draft,
        num_context_tokens=num_context,
        num_weighted_context_tokens=sum(map(mul, k, context_lens)) + num_context,  # Σ (k_i + 1) c_i
    )


def pad_to_bucket(n, buckets: np.ndarray | None):
    """(padded n, is over the largest bucket) for ints or arrays; no buckets: (n, False).
    ``buckets`` is sorted ascending; n pads up to the smallest bucket >= n."""
    if buckets is None:
        return n, np.zeros_like(n, dtype=bool) if isinstance(n, np.ndarray) else False
    if not isinstance(n, np.ndarray):  # one int: a bisection (np.searchsorted's side="left"), no numpy call
        idx = bisect_left(buckets, n)
        return (n, True) if idx >= len(buckets) else (int(buckets[idx]), False)
    idx = np.searchsorted(buckets, n, side="left")
    over = idx >= len(buckets)
    padded = np.where(over, n, buckets[np.minimum(idx, len(buckets) - 1)])
    return padded, over


def score_features(s: ShapeStats, is_expansion: bool, buckets: np.ndarray | None) -> list:
    """Score features of a scorer with one row per token (``is_expansion``) or per request, whose
    graphs were captured at ``buckets`` sizes (None: an eager scorer)."""
    rows = s.num_tokens if is_expansion else s.batch_size
    ctx, row_ctx = s.num_context_tokens / 1e3, s.num_weighted_context_tokens / 1e3
    if not isinstance(s.num_tokens, np.ndarray) and not isinstance(rows, np.ndarray):  # one shape
        if buckets is None:
            return [1.0, rows, s.num_tokens, ctx, row_ctx, 0.0]
        rows_p, eager = pad_to_bucket(rows, buckets)
        tokens_p, tokens_over = (rows_p, eager) if is_expansion else pad_to_bucket(s.num_tokens, buckets)
        if eager or tokens_over:  # eager runs are not padded
            return [1.0, rows, s.num_tokens, ctx, row_ctx, 1.0]
        return [1.0, rows_p, tokens_p, ctx, row_ctx, 0.0]
    rows_p, rows_over = pad_to_bucket(rows, buckets)
    tokens_p, tokens_over = (rows_p, rows_over) if is_expansion else pad_to_bucket(s.num_tokens, buckets)
    eager = rows_over | tokens_over
    if buckets is not None:  # eager runs are not padded
        rows_p, tokens_p = np.where(eager, rows, rows_p), np.where(eager, s.num_tokens, tokens_p)
    return [1.0, rows_p, tokens_p, ctx, row_ctx, eager * 1.0]


def propose_features(s: ShapeStats) -> list:
    return [1.0, s.max_k, s.max_k * s.num_spec_requests, s.num_draft_tokens]


def verify_features(s: ShapeStats) -> list:
    return [1.0, s.num_tokens]


def overhead_features(s: ShapeStats) -> list:
    return [1.0, s.batch_size]
