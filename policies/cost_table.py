"""Vectorised cost predictions for many candidate plans of one step, over several scorers at once.

:meth:`CostModels.predict_stats` predicts one scorer's shapes from their aggregates; a policy that
searches (``goodput``) wants every scorer × every candidate of a step in a handful of numpy
operations. :class:`CostTable` reads the online models' coefficients once per step and folds every
term that depends only on a candidate's token count (bucket padding, the eager flag and their
coefficients) into a ``[S, N]`` table, so a prediction is one gather plus a few array operations.
Its numbers equal :meth:`CostModels.predict` for the same shape (the tests check it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from specsched.policies.cost_model import CostModels

__all__ = ["CostTable", "bucket_table"]


@lru_cache(maxsize=256)
def bucket_table(buckets: tuple[int, ...] | None, is_expansion: bool, batch_size: int, size: int):
    """``[4, size]`` float64: the score features (1, rows padded, tokens padded, is_eager) as a
    function of a step's token count n = Σ (k_i+1), as :func:`specsched.policies.shapes.score_features`
    computes them."""
    n = np.arange(size, dtype=np.int64)
    if buckets is None:
        rows = n if is_expansion else np.full(size, batch_size)
        out = np.stack([np.ones(size), rows, n, np.zeros(size)]).astype(np.float64)
    else:
        b = np.asarray(buckets, dtype=np.int64)

        def pad(x):
            idx = np.searchsorted(b, x, side="left")
            over = idx >= len(b)
            return np.where(over, x, b[np.minimum(idx, len(b) - 1)]), over

        tokens_p, tokens_over = pad(n)
        if is_expansion:
            rows, rows_p, rows_over = n, tokens_p, tokens_over
        else:
            rows = np.full(size, batch_size)
            rows_p, rows_over = pad(rows)
        eager = rows_over | tokens_over
        rows_p, tokens_p = np.where(eager, rows, rows_p), np.where(eager, n, tokens_p)
        out = np.stack([np.ones(size), rows_p, tokens_p, eager]).astype(np.float64)
    out.flags.writeable = False  # shared through the cache
    return out


@dataclass(frozen=True)
class _Layout:
    """What a step's table needs that depends only on the scorers, batch size and table size."""

    feats: np.ndarray  # [S, 4, size] score features by token count
    offsets: np.ndarray  # [S, 1] start of each scorer's row in the flattened table
    is_expansion: np.ndarray  # [S] 1.0 for scorers with one row per token
    rows: np.ndarray  # [B] 0..B-1, for gathers
    size: int
    graphs: tuple[tuple[tuple[int, int], ...], ...]  # [S] each scorer's graphs (rows, tokens) used
    graph_index: np.ndarray  # [S, size] each token count's graph in ``graphs[s]`` (len: eager)


def _graphs(feats: np.ndarray) -> tuple[tuple[tuple[int, int], ...], np.ndarray]:
    """The graphs ``(rows padded, tokens padded)`` a scorer's token counts run in (feats ``[4, size]``
    from :func:`bucket_table`), and each count's index among them (``len(graphs)``: eager)."""
    is_eager = feats[3] > 0
    pairs = np.stack([feats[1], feats[2]]).astype(np.int64)  # [2, size]
    graphs, index = np.unique(pairs[:, ~is_eager], axis=1, return_inverse=True)
    out = np.full(feats.shape[1], graphs.shape[1], dtype=np.int64)
    out[~is_eager] = index.ravel()
    return tuple(zip(graphs[0].tolist(), graphs[1].tolist())), out


@lru_cache(maxsize=64)
def _layout(keys: tuple, batch_size: int, size: int) -> _Layout:
    """The :class:`_Layout` of scorers given as ``(buckets, is_expansion)`` pairs."""
    feats = np.stack([bucket_table(b, e, batch_size, size) for b, e in keys])
    feats.flags.writeable = False
    # only graph scorers have graphs (and residuals); an eager scorer's counts all map past its none
    graphs, index = zip(
        *(_graphs(f) if b is not None else ((), np.zeros(size, np.int64)) for (b, _), f in zip(keys, feats))
    )
    graph_index = np.stack(index)
    graph_index.flags.writeable = False
    return _Layout(
        feats,
        np.arange(len(keys))[:, None] * size,
        np.array([e for _, e in keys], dtype=np.float64),
        np.arange(batch_size),
        size,
        graphs,
        graph_index,
    )


class CostTable:
    """One step's predictor of every scorer of ``scorers`` for many candidate plans at once.

    ``max_tokens`` bounds the token count of any candidate (B · (max k + 1)); ``ctx`` ``[B]`` are the
    requests' context lengths (fixed within a step). Every term that does not depend on the plan
    (overhead, the bias of verification, the prefix reads) is folded into the ``[S, size]`` table."""

    def __init__(
        self, costs: CostModels, scorers: list[str], proposer: str, ctx: np.ndarray, max_tokens: int
    ) -> None:
        batch = len(ctx)
        self.scorers, self.ctx, self.batch_size = scorers, ctx, batch
        self.ctx_sum = float(ctx.sum())
        keys = []
        for s in scorers:
            b = costs.graph_buckets.get(s)
            keys.append((None if b is None else tuple(b.tolist()), s in costs.expansion_scorers))
        # table sizes are rounded up to a power of two so that steps share cached layouts
        layout = _layout(tuple(keys), batch, 1 << max(int(max_tokens).bit_length(), 4))
        self.size, self.offsets, self.rows = layout.size, layout.offsets, layout.rows
        coef = np.array([costs.model("score", s).coef for s in scorers])  # [S, 6]
        self.propose = p = costs.model("propose", proposer).coef.tolist()
        self.verify = v = costs.model("verify").coef.tolist()
        self.overhead_ms = float(costs.model("overhead").predict([1.0, float(batch)]))
        self.row_ctx_ms = coef[:, 4:5] / 1e3  # [S, 1] ms per weighted context token
        w = coef[:, [0, 1, 2, 5]]
        w[:, 0] += coef[:, 3] * (self.ctx_sum / 1e3)  # prefix reads do not depend on k
        self.flat = np.matmul(w[:, None, :], layout.feats).ravel()  # [S * size] score but row_ctx
        for i, s in enumerate(scorers):  # each graph's residual (policies/bucket_bias.py), if any
            bias = costs.biases.get(s)
            if bias:
                w_s = coef[i].tolist()
                values = np.array([bias.value(g, w_s) for g in layout.graphs[i]] + [0.0])
                self.flat[i * layout.size : (i + 1) * layout.size] += values[layout.graph_index[i]]
        # every feature is >= 0, so a component with no negative coefficient needs no clipping at 0
        self.is_clipped = min(p) < 0 or min(v) < 0 or bool((self.flat < 0).any() or (coef[:, 4] < 0).any())
        if not self.is_clipped:  # fold the plan-independent terms in: total = flat[n] + linear terms
            const = self.overhead_ms + v[0] + v[1] * batch
            self.flat_total = (
                self.flat.reshape(len(scorers), -1) + (self.row_ctx_ms * self.ctx_sum + const)
            ).ravel()
            self.draft_token_ms = v[1] + p[3]  # per draft token: verification and the proposer
        # marginal ms of one more draft token of each request, linearised (padding and clipping
        # ignored), [S, B]: for the goodput search
        per_token = layout.is_expansion * coef[:, 1] + coef[:, 2] + (v[1] + p[3])
        self.delta = np.maximum(per_token[:, None] + coef[:, 4:5] * (ctx / 1e3), 1e-6)
        self.spec_request_ms = max(p[2], 0.0)  # per drafting request per unit of max k

    def total_ms(self, k: np.ndarray) -> np.ndarray:
        """Predicted step ms ``[S, C]`` of candidate plans ``k``: ``[C, B]`` (the same candidates for
        every scorer) or ``[S, C, B]``."""
        num_draft = k.sum(-1)
        max_k = k.max(-1)
        num_tokens = num_draft + self.batch_size
        p = self.propose
        propose = max_k * (p[1] + p[2] * (k > 0).sum(-1))
        if not self.is_clipped:
            propose += p[0] * (max_k > 0) + self.draft_token_ms * num_draft
            return self.flat_total[self.offsets + num_tokens] + self.row_ctx_ms * (k @ self.ctx) + propose
        propose = np.where(max_k > 0, np.maximum(propose + p[0] + p[3] * num_draft, 0.0), 0.0)
        weighted = self.ctx_sum + k @ self.ctx
        score = np.maximum(self.flat[self.offsets + num_tokens] + self.row_ctx_ms * weighted, 0.0)
        verify = np.maximum(self.verify[0] + self.verify[1] * num_tokens, 0.0)
        return score + (propose + verify + self.overhead_ms)

    def components(self, k: np.ndarray, s: int) -> dict[str, float]:
        """Predicted ms per component of one plan ``k`` ``[B]`` under scorer index ``s``."""
        num_draft, max_k = int(k.sum()), int(k.max())
        num_tokens = num_draft + self.batch_size
        p, v = self.propose, self.verify
        propose = 0.0
        if max_k > 0:
            propose = max(p[0] + max_k * (p[1] + p[2] * int(np.count_nonzero(k))) + p[3] * num_draft, 0.0)
        weighted = self.ctx_sum + float(k @ self.ctx)
        score = max(float(self.flat[s * self.size + num_tokens] + self.row_ctx_ms[s, 0] * weighted), 0.0)
        verify = max(v[0] + v[1] * num_tokens, 0.0)
        return {
            "propose_ms": propose,
            "score_ms": score,
            "verify_ms": verify,
            "overhead_ms": self.overhead_ms,
            "total_ms": propose + score + verify + self.overhead_ms,
        }
