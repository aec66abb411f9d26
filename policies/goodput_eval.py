"""Exact goodput of candidate plans for the ``goodput`` search, with as few numpy calls as it takes.

G(k, s) = Σ_i E_i(k_i) / T_s(k): the expected tokens ``ecum[i, k_i]`` summed over the batch, over
the predicted step ms of :class:`~specsched.policies.cost_table.CostTable` — the same arithmetic as
``CostTable.total_ms``, in the same order, so the numbers are bit for bit those of evaluating
through the table. A plan's ms depends on it only through five aggregates (Σ k_i, max k_i, the
number of drafting requests, Σ k_i·ctx_i and, for the tokens, Σ_i E_i(k_i)):

- :meth:`PlanEvaluator.many` takes ``[C, B]`` candidates (the same for every scorer) or ``[S, C, B]``
  and computes the aggregates as array reductions: one pass for every scorer and candidate.
- :meth:`PlanEvaluator.one` takes one plan ``[B]`` for one scorer: the aggregates from a Python list
  of the plan and the ms in Python floats, a few microseconds where the array path pays numpy's
  per-call overhead some 30 times.
"""

from __future__ import annotations

from operator import mul

import numpy as np

from specsched.policies.cost_table import CostTable

__all__ = ["PlanEvaluator"]


class PlanEvaluator:
    """Goodput of plans of one step: ``table`` its cost table, ``ecum`` ``[B, J+1]`` expected tokens
    E_i(k) for k = 0..J, ``ctx`` ``[B]`` int context lengths."""

    def __init__(self, table: CostTable, ecum: np.ndarray, ctx: np.ndarray) -> None:
        self.table = table
        self.ecum_flat = ecum.ravel()  # [B * (J+1)]
        self.row_off = np.arange(len(ctx)) * ecum.shape[1]  # [B] start of each request's row
        self.ctx, self.ctx_list = ctx, ctx.tolist()
        self.row_ctx = table.row_ctx_ms[:, 0].tolist()  # [S] ms per weighted context token
        if table.is_clipped:  # verification ms by token count, clipped at 0 as total_ms clips it
            v = table.verify
            self.verify_ms = np.maximum(v[0] + v[1] * np.arange(table.size), 0.0)  # [size]

    def expected(self, k: np.ndarray) -> np.ndarray:
        """E_i(k_i) ``[..., B]`` of plans ``k`` ``[..., B]``."""
        return self.ecum_flat.take(k + self.row_off)

    def many(self, k: np.ndarray, expected: np.ndarray | None = None) -> np.ndarray:
        """Goodput ``[S, C]`` of ``k`` ``[C, B]`` or ``[S, C, B]``; ``expected`` = :meth:`expected`
        of ``k`` when the caller has it."""
        t = self.table
        e = (self.expected(k) if expected is None else expected).sum(-1)
        num_draft, max_k, weighted = k.sum(-1), k.max(-1), k @ self.ctx
        num_tokens = num_draft + t.batch_size
        p = t.propose
        propose = max_k * (p[1] + p[2] * (k > 0).sum(-1))
        if not t.is_clipped:
            propose += p[0] * (max_k > 0) + t.draft_token_ms * num_draft
            total = t.flat_total[t.offsets + num_tokens] + t.row_ctx_ms * weighted + propose
        else:
            propose = np.where(max_k > 0, np.maximum(propose + p[0] + p[3] * num_draft, 0.0), 0.0)
            score = np.maximum(t.flat[t.offsets + num_tokens] + t.row_ctx_ms * (t.ctx_sum + weighted), 0.0)
            total = score + (propose + self.verify_ms[num_tokens] + t.overhead_ms)
        return e / np.maximum(total, 1e-9)

    def one(self, k: np.ndarray, s: int) -> float:
        """Goodput of plan ``k`` ``[B]`` under scorer index ``s`` (= ``many(k[None])[s, 0]``)."""
        return self.price(k.tolist(), float(self.expected(k).sum()), s)

    def price(self, ks: list[int], expected: float, s: int) -> float:
        """Goodput of plan ``ks`` (a list) under scorer index ``s`` given its expected tokens Σ E_i(k_i):
        the aggregates and the ms in Python floats (policies/goodput_small.py prices every plan so)."""
        t = self.table
        num_draft, max_k = sum(ks), max(ks)
        weighted = sum(map(mul, ks, self.ctx_list))
        num_tokens = num_draft + t.batch_size
        p = t.propose
        propose = max_k * (p[1] + p[2] * (len(ks) - ks.count(0)))
        if not t.is_clipped:
            propose += p[0] * (max_k > 0) + t.draft_token_ms * num_draft
            total = t.flat_total[s * t.size + num_tokens] + self.row_ctx[s] * weighted + propose
        else:
            propose = max(propose + p[0] + p[3] * num_draft, 0.0) if max_k > 0 else 0.0
            score = max(t.flat[s * t.size + num_tokens] + self.row_ctx[s] * (t.ctx_sum + weighted), 0.0)
            total = score + (propose + self.verify_ms[num_tokens] + t.overhead_ms)
        return expected / max(float(total), 1e-9)

    def components(self, ks: list[int], s: int) -> dict[str, float]:
        """``CostTable.components`` of plan ``ks`` (a list) under scorer index ``s``: its arithmetic,
        from the plan's aggregates in Python."""
        t = self.table
        num_draft, max_k = sum(ks), max(ks)
        num_tokens = num_draft + t.batch_size
        p, v = t.propose, t.verify
        propose = 0.0
        if max_k > 0:
            propose = max(p[0] + max_k * (p[1] + p[2] * (len(ks) - ks.count(0))) + p[3] * num_draft, 0.0)
        weighted = t.ctx_sum + float(sum(map(mul, ks, self.ctx_list)))
        score = max(float(t.flat[s * t.size + num_tokens] + self.row_ctx[s] * weighted), 0.0)
        verify = max(v[0] + v[1] * num_tokens, 0.0)
        return {
            "propose_ms": propose,
            "score_ms": score,
            "verify_ms": verify,
            "overhead_ms": t.overhead_ms,
            "total_ms": propose + score + verify + t.overhead_ms,
        }
