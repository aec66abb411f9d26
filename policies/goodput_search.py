"""The ``goodput`` policy's search, as pure functions over numpy arrays.

Terms (per step, B requests, S scorers, J = the largest k any request may take):
- ``powers`` ``[B, J]``: E[a_i^j] for j = 1..J under request i's Beta posterior over its acceptance
  rate a_i, i.e. the probability that draft j is accepted (all drafts before it were). With
  a ~ Beta(α, β), E[a^j] = Π_{m<j} (α + m) / (α + β + m).
- ``ecum`` ``[B, J+1]``: expected emitted tokens E_i(k) = 1 + Σ_{j<=k} E[a_i^j], the posterior
  expectation of Leviathan et al. (2023)'s (1 − a^(k+1)) / (1 − a). Averaging over the posterior
  (rather than plugging in its mean) values a young estimate's long drafts a little higher
  (E[a^j] >= E[a]^j): Bayes' expected tokens, with no lasting bias once the posterior is tight.
- goodput G(k, s) = Σ_i E_i(k_i) / T_s(k), T from :class:`~specsched.policies.cost_table.CostTable`.

Search: every "uniform" plan k_i = min(K, cap_i) for K = 0..J (exact for batch 1, and the fixed-k
plans any static policy could pick), then Dinkelbach's method (Dinkelbach 1967, "On nonlinear
fractional programming") from the best of them: with λ the scorer's best goodput so far, maximise
Σ E_i − λ T over k with T linearised (each draft of request i costs δ_i ms, each drafting request
the draft model's per-request cost at max k K); that splits per request — take draft j while
E[a_i^j] > λ δ_i, drop the request when its drafts do not pay for it — for every cap K at once;
then λ ← the exact best goodput, until it stops rising.
"""

from __future__ import annotations

import heapq
from functools import lru_cache

import numpy as np

from specsched.policies.cost_table import CostTable

__all__ = [
    "BatchProblem",
    "acceptance_powers",
    "evaluate",
    "expected_table",
    "fill_buckets",
    "fit_kv_blocks",
    "improve",
    "uniform_plans",
]


def acceptance_powers(mean: np.ndarray, std: np.ndarray, num: int) -> np.ndarray:
    """``[B, num]`` E[a^j], j = 1..num, for a ~ Beta with the given ``mean`` and ``std`` ``[B]`` (a
    std too large for a Beta of that mean counts as ~1 observation; std 0: the point a^j)."""
    mean = np.minimum(np.maximum(mean, 0.0), 1.0)
    strength = mean * (1.0 - mean) / np.maximum(std * std, 1e-300) - 1.0  # α + β
    strength = np.minimum(np.maximum(strength, 1.0), 1e9)[:, None]
    ratio = (mean[:, None] * strength + _steps(num)) / (strength + _steps(num))
    return np.cumprod(ratio, axis=1)


@lru_cache(maxsize=32)
def _steps(num: int) -> np.ndarray:
    out = np.arange(num, dtype=np.float64)
    out.flags.writeable = False
    return out


def expected_table(powers: np.ndarray) -> np.ndarray:
    """``[B, J+1]``: E_i(k) for k = 0..J."""
    out = np.ones((powers.shape[0], powers.shape[1] + 1))
    np.cumsum(powers, axis=1, out=out[:, 1:])
    out[:, 1:] += 1.0
    return out


def evaluate(table: CostTable, ecum: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Exact goodput ``[S, C]`` of candidate plans ``k``: ``[C, B]`` (the same for every scorer) or
    ``[S, C, B]``."""
    return ecum[table.rows, k].sum(-1) / np.maximum(table.total_ms(k), 1e-9)


def uniform_plans(cap: np.ndarray) -> np.ndarray:
    """``[J+1, B]``: k_i = min(K, cap_i) for K = 0..max cap."""
    return np.minimum(np.arange(int(cap.max()) + 1)[:, None], cap[None, :])


def improve(
    table: CostTable, powers: np.ndarray, ecum: np.ndarray, caps: np.ndarray, lam: np.ndarray
) -> np.ndarray:
    """One Dinkelbach step for every scorer and cap K at once (``caps`` ``[K+1, B]`` from
    :func:`uniform_plans`): ``[S, K+1, B]`` plans that maximise Σ E_i − λ_s T (T linearised) at
    λ_s = ``lam`` ``[S]``."""
    lam = lam[:, None, None]
    kstar = (powers[None] > lam * table.delta[:, :, None]).sum(-1)  # [S, B]: a prefix (E[a^j] falls)
    k = np.minimum(kstar[:, None, :], caps[None])  # [S, K+1, B]
    # a request drafts only if its drafts pay for its share of the draft model at max k = K
    fixed = table.spec_request_ms * np.arange(caps.shape[0])[:, None]  # [K+1, 1]
    gain = ecum[table.rows, k] - 1.0 - lam * (table.delta[:, None, :] * k + fixed)
    return np.where(gain > 0, k, 0)


def fill_buckets(buckets: np.ndarray, k: np.ndarray, cap: np.ndarray, powers: np.ndarray) -> list[np.ndarray]:
    """Plans near ``k`` ``[B]`` that fit a graph scorer's buckets: the padding filled with the most
    valuable missing drafts (up to ``cap``), and the drafts above the next smaller bucket dropped
    (the least valuable); each keeps every request's drafts a prefix."""
    tokens = len(k) + int(k.sum())
    if tokens > buckets[-1]:
        return []
    idx = int(np.searchsorted(buckets, tokens))
    free = int(buckets[idx]) - tokens
    excess = tokens - int(buckets[idx - 1]) if idx > 0 else 0
    j = np.arange(1, powers.shape[1] + 1)[None, :]
    out = []
    for mask, count, sign in ((j > k[:, None]) & (j <= cap[:, None]), free, 1), (j <= k[:, None], excess, -1):
        count = min(count, int(mask.sum()))
        if count <= 0:
            continue
        value = np.where(mask, sign * powers, -np.inf).ravel()
        rows = np.argsort(-value, kind="stable")[:count] // powers.shape[1]
        out.append(k + sign * np.bincount(rows, minlength=len(k)))
    return out


def fit_kv_blocks(
    k: np.ndarray, ctx: np.ndarray, a: np.ndarray, num_free_blocks: int, block_size: int
) -> tuple[np.ndarray, int]:
    """Cut k until the lookahead fits: request i holds ceil(ctx_i / bs) blocks and needs
    ceil((ctx_i + k_i) / bs). Each cut frees one block from the request that loses the fewest
    expected tokens doing so (Σ a^j over the drafts dropped). Returns (k, number of cuts)."""
    if num_free_blocks >= len(k) * (int(k.max(initial=0)) // block_size + 1):
        return k, 0  # each request needs at most max_k // block_size + 1 more blocks
    ctx = ctx.astype(np.int64)
    held = -(-ctx // block_size)
    need = -(-(ctx + k) // block_size) - held
    over = int(need.sum()) - num_free_blocks
    if over <= 0:
        return k, 0
    k, num_cuts, heap = k.copy(), 0, []

    def push(i: int) -> None:
        if k[i] > 0 and need[i] > 0:  # a lookahead inside held blocks frees nothing when cut
            target = max(0, int((held[i] + need[i] - 1) * block_size - ctx[i]))  # one block fewer
            loss = sum(float(a[i]) ** j for j in range(target + 1, int(k[i]) + 1))
            heapq.heappush(heap, (loss, i, target))

    for i in range(len(k)):
        push(i)
    while over > 0 and heap:
        _, i, target = heapq.heappop(heap)
        k[i], need[i], over, num_cuts = target, need[i] - 1, over - 1, num_cuts + 1
        push(i)
    return k, num_cuts


class BatchProblem:
    """One step's search for B requests (numpy); plans are int arrays ``[B]``. The interface the
    policy drives, shared with :class:`specsched.policies.goodput_single.SingleProblem`:
    ``best_k[s]``, ``best_goodput[s]``, ``goodput_k0[s]`` per scorer after the search, then
    :meth:`goodput`, :meth:`hold`, :meth:`probe`, :meth:`dither`, :meth:`fit_kv`, :meth:`components`."""

    def __init__(
        self, costs, scorers, proposer, mean, std, ctx, cap, max_iters, scorer_margin, optimism=0.0
    ) -> None:
        self.mean, self.std, self.ctx, self.cap = mean, std, ctx, cap
        self.top = int(cap.max())
        plan_mean = np.minimum(mean + optimism * std, 1.0 - 1e-6) if optimism else mean
        self.powers = acceptance_powers(plan_mean, std, max(self.top, 1))
        self.ecum = expected_table(self.powers)
        self.table = CostTable(costs, scorers, proposer, ctx, len(cap) * (self.top + 1))
        self.buckets = [costs.graph_buckets.get(s) for s in scorers]
        self.max_iters, self.scorer_margin = max_iters, scorer_margin
        k, g, g_k0 = self._search(self.powers, self.ecum)
        self.best_k = list(k)  # [S] plans
        self.best_goodput, self.goodput_k0 = g.tolist(), g_k0.tolist()

    def _search(self, powers, ecum):
        """Best plan ``[S, B]``, its goodput ``[S]`` and the k = 0 goodput ``[S]`` per scorer."""
        table, cap = self.table, self.cap
        plans = uniform_plans(cap)  # [K+1, B]
        g = evaluate(table, ecum, plans)  # [S, K+1]
        s_idx = np.arange(g.shape[0])
        best = g.argmax(-1)
        k, g_best, g_k0 = plans[best], g[s_idx, best], g[:, 0].copy()
        if len(cap) > 1:
            last = None
            for _ in range(self.max_iters):
                cand = improve(table, powers, ecum, plans, g_best)  # [S, K+1, B]
                if last is not None and np.array_equal(cand, last):
                    break  # λ did not move the plans: evaluated already
                last = cand
                g = evaluate(table, ecum, cand)
                best = g.argmax(-1)
                better = g[s_idx, best] > g_best * (1.0 + 1e-12)
                if not better.any():
                    break
                k[better], g_best[better] = cand[s_idx, best][better], g[s_idx, best][better]
            contenders = g_best >= g_best.max() / (1.0 + self.scorer_margin)
            for s, b in enumerate(self.buckets):
                if b is not None and contenders[s]:  # only a scorer that could be chosen
                    for c in fill_buckets(b, k[s], cap, powers):
                        g_c = float(evaluate(table, ecum, c[None, :])[s, 0])
                        if g_c > g_best[s]:
                            k[s], g_best[s] = c, g_c
        return k, g_best, g_k0

    def goodput(self, k: np.ndarray, s: int) -> float:
        return float(evaluate(self.table, self.ecum, k[None, :])[s, 0])

    def hold(self, k, g: float, last: list[int], s: int, margin: float):
        """Keep a request's last k unless changing it gains more than ``margin`` of its expected
        tokens, valued at goodput ``g`` (ΔE − G·ΔT, ΔT linearised); the held plan is kept only if
        its exact goodput is within ``margin`` of ``g``. Returns (plan, goodput, number held)."""
        last = np.minimum(last, self.cap)
        if (last == k).all():
            return k, g, 0
        rows, ecum, table = self.table.rows, self.ecum, self.table
        e_new, e_old = ecum[rows, k], ecum[rows, last]
        per_request = table.spec_request_ms * max(int(k.max()), int(last.max()))
        d_time = (k - last) * table.delta[s] + per_request * ((k > 0) * 1.0 - (last > 0) * 1.0)
        is_held = (last != k) & ((e_new - e_old) - g * d_time < margin * e_new)
        if not is_held.any():
            return k, g, 0
        held = np.where(is_held, last, k)
        g_held = self.goodput(held, s)
        if g_held < g * (1.0 - margin):
            return k, g, 0
        return held, g_held, int(is_held.sum())

    def can_probe(self, k) -> bool:
        """Whether the plan leaves at k = 0 a request that could draft."""
        return bool(((k == 0) & (self.cap > 0)).any())

    def probe(self, z: float, s: int):
        """The best plan for scorer ``s`` under optimistic acceptance a + z·std (point estimates)."""
        a = np.minimum(self.mean + z * self.std, 1.0 - 1e-6)
        powers = acceptance_powers(a, np.zeros_like(a), max(self.top, 1))
        return self._search(powers, expected_table(powers))[0][s]

    def dither(self, k, g: float, direction: int, s: int, tolerance: float):
        """(k ± 1 within [1, cap] for the requests that draft — ``direction`` first, the other way
        when that changes nothing — or None when neither changes anything or the change is predicted
        worse than ``g`` by more than ``tolerance``; the direction for next time)."""
        spec = k > 0
        if spec.any():
            for step in (direction, -direction):
                cand = np.where(spec, np.clip(k + step, 1, self.cap), 0)
                if (cand != k).any():
                    return (cand if self.goodput(cand, s) >= g * (1.0 - tolerance) else None), -step
        return None, direction

    def fit_kv(self, k, num_free_blocks: int, block_size: int):
        return fit_kv_blocks(k, self.ctx, self.mean, num_free_blocks, block_size)

    def components(self, k, s: int) -> dict[str, float]:
        return self.table.components(k, s)

    def expected_at_mean(self, k) -> float:
        """Σ_i (1 − a_i^(k_i+1)) / (1 − a_i) at the posterior means (what every policy reports)."""
        a = np.minimum(self.mean, 1.0 - 1e-6)
        return float(((1.0 - a ** (k + 1)) / (1.0 - a)).sum())

    @staticmethod
    def as_list(k) -> list[int]:
        return k.tolist()
