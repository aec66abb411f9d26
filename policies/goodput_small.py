"""The ``goodput`` search for a small batch (2 to ``plain_search_max_batch`` requests), in plain Python.

:class:`~specsched.policies.goodput_search.BatchProblem` evaluates its candidates as numpy arrays of
B × J elements; at B = 4 each of its ~150 numpy calls a decide costs more than the arithmetic in it,
and a goodput decide took 0.66 ms (median) on the H200's host at N = 4 (2026-12-06 22:19 log), where
the GPU's scoring window is ~1 ms: a decide made ahead during it overran the window, and pushed the
daemon's IO and log threads onto the next step's launch (docs/benchmarks.md). This module runs the
same search — uniform plans, Dinkelbach's steps, the graph buckets' fills and trims, and the policy's
hold / probe / dither / KV fit / intent on the result — over lists of Python ints and floats.

It decides as BatchProblem does, bit for bit: the cost table is BatchProblem's own
(:class:`~specsched.policies.cost_table.CostTable`), each plan's goodput is
:meth:`~specsched.policies.goodput_eval.PlanEvaluator.price` (``one``'s own arithmetic), and each sum over the
batch is a left-to-right sum, which is what numpy's reductions do below 8 elements (from 8 on they
sum pairwise, hence the bound on B; tests/policies/test_goodput_small.py checks every method against
BatchProblem). Terms as in :mod:`specsched.policies.goodput_search`.
"""

from __future__ import annotations

import numpy as np

from specsched.policies.cost_table import CostTable
from specsched.policies.goodput_eval import PlanEvaluator
from specsched.policies.goodput_search import fit_kv_blocks

__all__ = ["MAX_EXACT_BATCH", "SmallProblem"]

MAX_EXACT_BATCH = 7  # numpy sums 8 or more elements pairwise: beyond this the two paths may round apart


def _survival(mean: float, std: float, num: int) -> list[float]:
    """goodput_search.acceptance_powers for one request: E[a^j], j = 1..num, a ~ Beta(mean, std)."""
    m = min(max(mean, 0.0), 1.0)
    strength = min(max(m * (1.0 - m) / max(std * std, 1e-300) - 1.0, 1.0), 1e9)
    out, pw, base = [], 1.0, m * strength
    for j in range(num):
        pw *= (base + j) / (strength + j)
        out.append(pw)
    return out


def _expected(powers: list[list[float]]) -> list[list[float]]:
    """goodput_search.expected_table over rows: E_i(k) = 1 + Σ_{j<=k} powers[i][j-1], k = 0..J."""
    out = []
    for row in powers:
        total, e = 0.0, [1.0]
        for p in row:
            total += p
            e.append(total + 1.0)
        out.append(e)
    return out


class SmallProblem:
    """One step's search for a few requests; plans are lists of ints. BatchProblem's interface and
    numbers (module docstring)."""

    def __init__(
        self, costs, scorers, proposer, mean, std, ctx, cap, max_iters, scorer_margin, optimism=0.0,
        powers=None,
    ) -> None:  # fmt: skip
        """``mean``, ``std`` ``[B]`` floats, ``ctx``, ``cap`` ``[B]`` ints (numpy arrays, as for
        BatchProblem); ``powers`` ``[B, >= J]``: the drafts' survival from another acceptance model."""
        self.mean, self.std = mean.tolist(), std.tolist()
        self.ctx, self.cap = ctx.tolist(), cap.tolist()
        self._mean_arr, self._ctx_arr = mean, ctx  # for fit_kv_blocks
        self.batch_size = len(self.cap)
        self.top = max(self.cap)
        num = max(self.top, 1)
        if powers is not None:  # [B, >= J] array, or rows as lists
            rows = powers[:, :num].tolist() if isinstance(powers, np.ndarray) else [r[:num] for r in powers]
        else:
            means = self.mean
            if optimism:
                means = [min(m + optimism * sd, 1.0 - 1e-6) for m, sd in zip(means, self.std)]
            rows = [_survival(m, sd, num) for m, sd in zip(means, self.std)]
        self.powers, self.ecum = rows, _expected(rows)  # [B][J], [B][J+1]
        self.table = table = CostTable(costs, scorers, proposer, ctx, self.batch_size + sum(self.cap))
        self.eval = PlanEvaluator(table, np.asarray(self.ecum), ctx)
        self.delta = table.delta.tolist()  # [S][B]
        self.spec_request_ms = table.spec_request_ms
        self.num_scorers = len(scorers)
        self.buckets = [
            None if b is None else b.tolist() for b in (costs.graph_buckets.get(s) for s in scorers)
        ]
        self.max_iters, self.scorer_margin = max_iters, scorer_margin
        k, g, g_k0 = self._search(self.powers, self.ecum)
        self.best_k = k  # [S] plans
        self.best_goodput, self.goodput_k0 = g, g_k0

    # ---- the search -------------------------------------------------------------------------------
    def _search(self, powers: list[list[float]], ecum: list[list[float]]):
        """Best plan per scorer, its goodput and the k = 0 goodput per scorer (BatchProblem._search)."""
        cap, num_s, price = self.cap, self.num_scorers, self.eval.price
        plans = [[c if c < top else top for c in cap] for top in range(max(cap) + 1)]  # uniform_plans
        g = [[price(p, _tokens(ecum, p), s) for p in plans] for s in range(num_s)]
        best = [row.index(max(row)) for row in g]  # argmax: the first best
        k = [plans[b] for b in best]
        g_best = [row[b] for row, b in zip(g, best)]
        g_k0 = [row[0] for row in g]
        fixed = [self.spec_request_ms * top for top in range(len(plans))]
        last = None
        for _ in range(self.max_iters):
            cand, e = self._improve(powers, ecum, plans, g_best, fixed)  # [S][K+1] plans, tokens
            if last is not None and cand == last:
                break  # λ did not move the plans: evaluated already
            last = cand
            better = False
            for s in range(num_s):
                row, prev = [], None
                for p, es in zip(cand[s], e[s]):  # plans for caps past every request's k* repeat
                    row.append(row[-1] if p == prev else price(p, es, s))
                    prev = p
                g_new = max(row)
                if g_new > g_best[s] * (1.0 + 1e-12):
                    k[s], g_best[s], better = cand[s][row.index(g_new)], g_new, True
            if not better:
                break
        top = max(g_best) / (1.0 + self.scorer_margin)
        for s, b in enumerate(self.buckets):
            if b is not None and g_best[s] >= top:  # only a scorer that could be chosen
                for c in _fill_buckets(b, k[s], cap, powers):
                    g_c = price(c, _tokens(ecum, c), s)
                    if g_c > g_best[s]:
                        k[s], g_best[s] = c, g_c
        return k, g_best, g_k0

    def _improve(self, powers, ecum, plans, lam, fixed):
        """goodput_search.improve: for each scorer s, request i drafts while E[a^j] > λ_s δ_si, capped
        by each uniform plan's cap, and only if its drafts pay for its share of the draft model."""
        cand, tokens = [], []
        for s in range(self.num_scorers):
            lam_s, delta_s = lam[s], self.delta[s]
            kstar = [sum(1 for p in row if p > lam_s * d) for row, d in zip(powers, delta_s)]
            plans_s, tokens_s = [], []
            for caps, fix in zip(plans, fixed):
                plan, total = [], 0.0
                for ks, c, d, erow in zip(kstar, caps, delta_s, ecum):
                    kk = ks if ks < c else c
                    e = erow[kk]
                    if e - 1.0 - lam_s * (d * kk + fix) > 0:
                        plan.append(kk)
                        total += e
                    else:
                        plan.append(0)
                        total += 1.0
                plans_s.append(plan)
                tokens_s.append(total)
            cand.append(plans_s)
            tokens.append(tokens_s)
        return cand, tokens

    # ---- the policy's interface (BatchProblem's) ------------------------------------------------------
    def goodput(self, k: list[int], s: int) -> float:
        return self.eval.price(k, _tokens(self.ecum, k), s)

    def hold(self, k, g: float, last, s: int, margin: float):
        """BatchProblem.hold over lists."""
        last = [x if x < c else c for x, c in zip(last, self.cap)]
        if last == k:
            return k, g, 0
        delta, ecum = self.delta[s], self.ecum
        per_request = self.spec_request_ms * max(max(k), max(last))
        held, num_held = [], 0
        for i, (new, old) in enumerate(zip(k, last)):
            if new != old:
                e_new = ecum[i][new]
                d_time = (new - old) * delta[i] + per_request * float((new > 0) - (old > 0))
                if (e_new - ecum[i][old]) - g * d_time < margin * e_new:
                    held.append(old)
                    num_held += 1
                    continue
            held.append(new)
        if not num_held:
            return k, g, 0
        g_held = self.goodput(held, s)
        if g_held < g * (1.0 - margin):
            return k, g, 0
        return held, g_held, num_held

    def intent(self, k, lam: float, s: int, max_k: int) -> list[int] | None:
        """BatchProblem.intent over lists (see there)."""
        is_graph = self.token_budget(k, s) is not None
        idx = [
            i
            for i, (kk, c) in enumerate(zip(k, self.cap))
            if (kk >= c and c < max_k) or (is_graph and 0 < kk < max_k)
        ]
        if not idx:
            return None
        delta, rate = self.delta[s], self.spec_request_ms * max_k
        own = len(self.powers[0]) >= max_k  # the search's powers (every offer max_k: a decide ahead)
        if not own:
            rows = [_survival(self.mean[i], self.std[i], max_k) for i in idx]
        out = list(k)
        for n, i in enumerate(idx):
            d = delta[i]
            row = self.powers[i][:max_k] if own else rows[n]
            kstar = sum(1 for p in row if p > lam * d)
            if own:
                gain = self.ecum[i][kstar if kstar > 1 else 1] - 1.0
            else:
                gain = sum(row[: kstar if kstar > 1 else 1])  # cumsum's element: a left-to-right sum
            pays = gain - lam * (d * kstar + rate) > 0
            out[i] = max(k[i], kstar if pays else 0)
        return None if is_graph and out == list(k) else out

    def token_budget(self, k, s: int) -> int | None:
        b = self.buckets[s]
        if b is None:
            return None
        tokens = self.batch_size + sum(k)
        return next((x for x in b if x >= tokens), None)

    def can_probe(self, k) -> bool:
        return any(kk == 0 and c > 0 for kk, c in zip(k, self.cap))

    def probe(self, z: float, s: int) -> list[int]:
        num = max(self.top, 1)
        powers = [_survival(min(m + z * sd, 1.0 - 1e-6), 0.0, num) for m, sd in zip(self.mean, self.std)]
        return self._search(powers, _expected(powers))[0][s]

    def dither(self, k, g: float, direction: int, s: int, tolerance: float):
        if any(k):
            for step in (direction, -direction):
                cand = [min(max(kk + step, 1), c) if kk > 0 else 0 for kk, c in zip(k, self.cap)]
                if cand != k:
                    return (cand if self.goodput(cand, s) >= g * (1.0 - tolerance) else None), -step
        return None, direction

    def fit_kv(self, k, num_free_blocks: int, block_size: int):
        if num_free_blocks >= len(k) * (max(k) // block_size + 1):
            return k, 0  # fit_kv_blocks' own first test, without the arrays
        cut, num_cuts = fit_kv_blocks(
            np.array(k, dtype=np.int64), self._ctx_arr, self._mean_arr, num_free_blocks, block_size
        )
        return cut.tolist(), num_cuts

    def components(self, k, s: int) -> dict[str, float]:
        return self.eval.components(list(k), s)

    def expected_at_mean(self, k) -> float:
        total = 0.0
        for m, kk in zip(self.mean, k):
            a = m if m < 1.0 - 1e-6 else 1.0 - 1e-6
            total += (1.0 - a ** (kk + 1)) / (1.0 - a)
        return total

    @staticmethod
    def as_list(k) -> list[int]:
        return list(k)

    def zeros(self) -> list[int]:
        return [0] * self.batch_size


def _tokens(ecum: list[list[float]], k: list[int]) -> float:
    """Σ_i E_i(k_i), left to right."""
    total = 0.0
    for row, kk in zip(ecum, k):
        total += row[kk]
    return total


def _fill_buckets(
    buckets: list[int], k: list[int], cap: list[int], powers: list[list[float]]
) -> list[list[int]]:
    """goodput_search.fill_buckets over lists: the plan's padding filled with the most valuable
    missing drafts, and the drafts above the next smaller bucket dropped (the least valuable)."""
    batch = len(k)
    tokens = batch + sum(k)
    if tokens > buckets[-1]:
        return []
    idx = next(i for i, b in enumerate(buckets) if b >= tokens)
    free = buckets[idx] - tokens
    excess = tokens - buckets[idx - 1] if idx > 0 else 0
    out = []
    if free > 0:  # the missing drafts j in (k_i, cap_i], most valuable first (ties: batch order)
        missing = [
            (-row[j - 1], i)
            for i, (row, kk, c) in enumerate(zip(powers, k, cap))
            for j in range(kk + 1, c + 1)
        ]
        if missing:
            missing.sort()
            plan = list(k)
            for _, i in missing[:free]:
                plan[i] += 1
            out.append(plan)
    if excess > 0 and tokens > batch:  # the drafts j <= k_i, least valuable first
        drafts = sorted(
            (row[j - 1], i) for i, (row, kk) in enumerate(zip(powers, k)) for j in range(1, kk + 1)
        )
        plan = list(k)
        for _, i in drafts[: min(excess, tokens - batch)]:
            plan[i] -= 1
        out.append(plan)
    return out
