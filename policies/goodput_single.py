"""The ``goodput`` search for a batch of one request, in plain Python.

At batch 1 — the latency-bound case, where a step is a few ms and the policy's own time shows —
the plans are k = 0..cap for each scorer, so the search is a table of at most S × 9 exact
goodputs. Numpy's per-call overhead would dominate it; this module computes the same numbers as
:class:`specsched.policies.goodput_search.BatchProblem` (same cost model, same posterior
expectation, same rules: the tests check that both decide alike) with Python floats.
"""

from __future__ import annotations

from functools import lru_cache

from specsched.policies.cost_model import CostModels
from specsched.policies.cost_table import bucket_table

__all__ = ["SingleProblem"]


@lru_cache(maxsize=256)
def _features(buckets: tuple[int, ...] | None, is_expansion: bool, size: int) -> tuple[list, ...]:
    """(rows padded, tokens padded, is_eager) by token count, as lists (batch of one)."""
    return tuple(bucket_table(buckets, is_expansion, 1, size)[1:].tolist())


_BY_ARRAY: dict[tuple[int, bool, int], tuple] = {}  # (id(buckets), is_expansion, size) -> (buckets, features)


def _scorer_features(buckets, is_expansion: bool, size: int) -> tuple[list, ...]:
    """:func:`_features` of a scorer's bucket array, found by the array's identity (a cost model's
    buckets do not change): no tuple of the buckets to build and hash every step. The entry holds
    the array, so its id is not reused while cached."""
    key = (id(buckets), is_expansion, size)
    found = _BY_ARRAY.get(key)
    if found is None or found[0] is not buckets:
        if len(_BY_ARRAY) >= 256:
            _BY_ARRAY.clear()
        feats = _features(None if buckets is None else tuple(buckets.tolist()), is_expansion, size)
        found = _BY_ARRAY[key] = (buckets, feats)
    return found[1]


def _model(costs: CostModels, models: dict, key: tuple[str, ...]):
    """``costs.model(*key)``, without the call when the model exists."""
    found = models.get(key)
    return found if found is not None else costs.model(*key)


class SingleProblem:
    """One step's search for one request; plans are ints (its k). The interface is
    :class:`~specsched.policies.goodput_search.BatchProblem`'s."""

    def __init__(
        self, costs: CostModels, scorers, proposer, mean, std, ctx, cap, optimism=0.0,
        survival: list[float] | None = None,
    ) -> None:  # fmt: skip
        """``survival``: the drafts' survival (draft 1, 2, ..., at least ``cap`` of them) from another
        acceptance model, as :class:`~specsched.policies.goodput_search.BatchProblem`'s ``powers``."""
        self.mean, self.std, self.ctx, self.cap = mean, std, ctx, cap
        self.top = cap
        if survival is not None:
            expected = [1.0]
            for p in survival[:cap]:
                expected.append(expected[-1] + p)
        else:
            plan_mean = min(mean + optimism * std, 1.0 - 1e-6) if optimism else mean
            expected = _expected(plan_mean, std, cap)
        self.expected = expected  # [cap + 1] posterior E(k)
        c = ctx / 1e3
        models = costs.models
        p = _model(costs, models, ("propose", proposer)).coef_list
        v = _model(costs, models, ("verify",)).coef_list
        o = _model(costs, models, ("overhead",)).coef_list
        self.overhead_ms = overhead = max(o[0] * 1.0 + o[1] * 1.0, 0.0)  # its predict([1, 1])
        self.spec_request_ms = max(p[2], 0.0)
        size = 1 << max(cap.bit_length() + 1, 4)
        per_k = p[1] + p[2] + p[3]
        propose = [0.0] + [x if x > 0.0 else 0.0 for x in [p[0] + kk * per_k for kk in range(1, cap + 1)]]
        verify = [x if x > 0.0 else 0.0 for x in [v[0] + v[1] * (kk + 1) for kk in range(cap + 1)]]
        self.delta, self.score, self.total, self.g = [], [], [], []
        graph_buckets, expansion = costs.graph_buckets, costs.expansion_scorers
        for s in scorers:
            w0, w1, w2, w3, w4, w5 = _model(costs, models, ("score", s)).coef_list
            is_exp = s in expansion
            rows, tokens, eager = _scorer_features(graph_buckets.get(s), is_exp, size)
            base, wc = w0 + w3 * c, w4 * c
            score = [base + w1 * rows[n] + w2 * tokens[n] + wc * n + w5 * eager[n] for n in range(1, cap + 2)]
            bias = costs.biases.get(s)
            if bias:  # each graph's residual (policies/bucket_bias.py); none for eager shapes
                score = [
                    x
                    if eager[n]
                    else x + bias.value((int(rows[n]), int(tokens[n])), (w0, w1, w2, w3, w4, w5))
                    for x, n in zip(score, range(1, cap + 2))
                ]
            score = [x if x > 0.0 else 0.0 for x in score]
            total = [sc + pr + ve + overhead for sc, pr, ve in zip(score, propose, verify)]
            g = [e / (t if t > 1e-9 else 1e-9) for e, t in zip(expected, total)]
            self.score.append(score)
            self.total.append(total)
            self.g.append(g)
            self.delta.append(max((w1 if is_exp else 0.0) + w2 + v[1] + p[3] + w4 * c, 1e-6))
        self.propose, self.verify = propose, verify
        self.best_k = best_k = [g.index(max(g)) for g in self.g]  # the first best k
        self.best_goodput = [g[k] for g, k in zip(self.g, best_k)]
        self.goodput_k0 = [g[0] for g in self.g]

    def goodput(self, k: int, s: int) -> float:
        return self.g[s][k]

    def hold(self, k: int, g: float, last: list[int], s: int, margin: float):
        """:meth:`BatchProblem.hold` for one request."""
        last = min(last[0], self.cap)
        if last == k:
            return k, g, 0
        e_new, e_old = self.expected[k], self.expected[last]
        per_request = self.spec_request_ms * max(k, last)
        d_time = (k - last) * self.delta[s] + per_request * ((k > 0) - (last > 0))
        if (e_new - e_old) - g * d_time >= margin * e_new:
            return k, g, 0
        g_held = self.g[s][last]
        if g_held < g * (1.0 - margin):
            return k, g, 0
        return last, g_held, 1

    def can_probe(self, k: int) -> bool:
        return k == 0 and self.cap > 0

    def probe(self, z: float, s: int) -> int:
        """The best k for scorer ``s`` under optimistic acceptance a + z·std (a point estimate)."""
        e = _expected(min(self.mean + z * self.std, 1.0 - 1e-6), 0.0, self.cap)
        total = self.total[s]
        return max(range(self.cap + 1), key=lambda kk: e[kk] / max(total[kk], 1e-9))

    def dither(self, k: int, g: float, direction: int, s: int, tolerance: float):
        """:meth:`BatchProblem.dither` for one request."""
        if k > 0:
            for step in (direction, -direction):
                cand = min(max(k + step, 1), self.cap)
                if cand != k:
                    return (cand if self.g[s][cand] >= g * (1.0 - tolerance) else None), -step
        return None, direction

    def fit_kv(self, k: int, num_free_blocks: int, block_size: int) -> tuple[int, int]:
        """Cut k until its lookahead fits the free KV blocks (each cut frees one block)."""
        held = -(-self.ctx // block_size)
        need = -(-(self.ctx + k) // block_size) - held
        if need <= num_free_blocks:
            return k, 0
        return max(0, (held + num_free_blocks) * block_size - self.ctx), need - num_free_blocks

    def components(self, k: int, s: int) -> dict[str, float]:
        return {
            "propose_ms": self.propose[k],
            "score_ms": self.score[s][k],
            "verify_ms": self.verify[k],
            "overhead_ms": self.overhead_ms,
            "total_ms": self.total[s][k],
        }

    def expected_at_mean(self, k: int) -> float:
        a = min(self.mean, 1.0 - 1e-6)
        return (1.0 - a ** (k + 1)) / (1.0 - a)

    @staticmethod
    def as_list(k: int) -> list[int]:
        return [k]

    @staticmethod
    def zeros() -> int:
        """The plan that drafts nothing."""
        return 0


def _expected(mean: float, std: float, cap: int) -> list[float]:
    """E(k) for k = 0..cap under the Beta of ``mean`` and ``std``
    (:func:`specsched.policies.goodput_search.acceptance_powers`)."""
    m = min(max(mean, 0.0), 1.0)
    strength = min(max(m * (1.0 - m) / max(std * std, 1e-300) - 1.0, 1.0), 1e9)
    out, pw = [1.0], 1.0
    for j in range(cap):
        pw *= (m * strength + j) / (strength + j)
        out.append(out[-1] + pw)
    return out
