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

Cost: the search runs on every decode step's critical path, where numpy's per-call overhead (not
the arrays, of B × J elements) is the time. Candidates are evaluated all at once
(:class:`~specsched.policies.goodput_eval.PlanEvaluator`), and single plans (the graph buckets'
fills and trims, the held plan, dither) through its plain-Python path.
"""

from __future__ import annotations

import heapq
from functools import lru_cache

import numpy as np

from specsched.policies.cost_table import CostTable
from specsched.policies.goodput_eval import PlanEvaluator

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
    table: CostTable,
    powers: np.ndarray,
    ev: PlanEvaluator,
    caps: np.ndarray,
    lam: np.ndarray,
    fixed: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One Dinkelbach step for every scorer and cap K at once (``caps`` ``[K+1, B]`` from
    :func:`uniform_plans`): ``[S, K+1, B]`` plans that maximise Σ E_i − λ_s T (T linearised) at
    λ_s = ``lam`` ``[S]``, and their expected tokens E_i(k_i) ``[S, K+1, B]``. ``fixed`` ``[K+1, 1]``:
    a drafting request's share of the draft model's ms at max k = K (computed when None)."""
    lam = lam[:, None, None]
    kstar = (powers[None] > lam * table.delta[:, :, None]).sum(-1)  # [S, B]: a prefix (E[a^j] falls)
    k = np.minimum(kstar[:, None, :], caps[None])  # [S, K+1, B]
    # a request drafts only if its drafts pay for its share of the draft model at max k = K
    if fixed is None:
        fixed = table.spec_request_ms * np.arange(caps.shape[0])[:, None]  # [K+1, 1]
    e = ev.expected(k)
    keep = e - 1.0 - lam * (table.delta[:, None, :] * k + fixed) > 0
    return np.where(keep, k, 0), np.where(keep, e, 1.0)  # E_i(0) = 1


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
    j = _steps(powers.shape[1]) + 1.0  # [J] 1..J
    kk = k[:, None]
    out = []
    for count, sign in (free, 1), (excess, -1):
        if count <= 0:
            continue
        mask = ((j > kk) & (j <= cap[:, None])) if sign > 0 else (j <= kk)  # [B, J] drafts it may move
        count = min(count, int(mask.sum()) if sign > 0 else tokens - len(k))  # trim: at most Σ k_i
        if count <= 0:
            continue
        key = np.where(mask, -powers if sign > 0 else powers, np.inf).ravel()  # most valuable first
        rows = np.argsort(key, kind="stable")[:count] // powers.shape[1]
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
        self, costs, scorers, proposer, mean, std, ctx, cap, max_iters, scorer_margin, optimism=0.0,
        powers=None,
    ) -> None:  # fmt: skip
        """``powers`` ``[B, >= J]``: the drafts' survival from another acceptance model (e.g.
        :func:`~specsched.policies.acceptance_stages.staged_powers`) instead of the single rate
        ``mean`` / ``std``'s (which probes and dither still use)."""
        self.mean, self.std, self.ctx, self.cap = mean, std, ctx, cap
        self.top = int(cap.max())
        num = max(self.top, 1)
        if powers is not None:
            self.powers = np.ascontiguousarray(powers[:, :num])  # [B, J]
        else:
            plan_mean = np.minimum(mean + optimism * std, 1.0 - 1e-6) if optimism else mean
            self.powers = acceptance_powers(plan_mean, std, num)  # [B, J]
        self.ecum = expected_table(self.powers)  # [B, J+1]
        # no candidate exceeds the caps: B + Σ cap_i tokens (a table of that size, not B·(max cap + 1),
        # is what the plans can index; it is also the range the table's check for clipping covers)
        self.table = CostTable(costs, scorers, proposer, ctx, len(cap) + int(cap.sum()))
        self.eval = PlanEvaluator(self.table, self.ecum, ctx)
        self.buckets = [costs.graph_buckets.get(s) for s in scorers]
        self.max_iters, self.scorer_margin = max_iters, scorer_margin
        k, g, g_k0 = self._search(self.powers, self.eval)
        self.best_k = list(k)  # [S] plans
        self.best_goodput, self.goodput_k0 = g.tolist(), g_k0.tolist()

    def _search(self, powers, ev: PlanEvaluator):
        """Best plan ``[S, B]``, its goodput ``[S]`` and the k = 0 goodput ``[S]`` per scorer."""
        table, cap = self.table, self.cap
        plans = uniform_plans(cap)  # [K+1, B]
        g = ev.many(plans)  # [S, K+1]
        best = g.argmax(-1)
        k, g_best, g_k0 = plans[best], g.max(-1), g[:, 0].copy()  # [S, B], [S], [S]
        if len(cap) > 1:
            last, fixed = None, table.spec_request_ms * np.arange(plans.shape[0])[:, None]
            for _ in range(self.max_iters):
                cand, e = improve(table, powers, ev, plans, g_best, fixed)  # [S, K+1, B]
                if last is not None and np.array_equal(cand, last):
                    break  # λ did not move the plans: evaluated already
                last = cand
                g = ev.many(cand, e)
                best = g.argmax(-1)
                g_new = g.max(-1)  # = g[s, best[s]]
                better = g_new > g_best * (1.0 + 1e-12)
                if not better.any():
                    break
                chosen = cand[np.arange(len(best)), best]  # [S, B]
                k, g_best = np.where(better[:, None], chosen, k), np.where(better, g_new, g_best)
            contenders = (g_best >= g_best.max() / (1.0 + self.scorer_margin)).tolist()
            for s, b in enumerate(self.buckets):
                if b is not None and contenders[s]:  # only a scorer that could be chosen
                    for c in fill_buckets(b, k[s], cap, powers):
                        g_c = ev.one(c, s)
                        if g_c > g_best[s]:
                            k[s], g_best[s] = c, g_c
        return k, g_best, g_k0

    def goodput(self, k: np.ndarray, s: int) -> float:
        return self.eval.one(k, s)

    def hold(self, k, g: float, last, s: int, margin: float):
        """Keep a request's last k (``last`` ``[B]`` ints) unless changing it gains more than
        ``margin`` of its expected tokens, valued at goodput ``g`` (ΔE − G·ΔT, ΔT linearised); the
        held plan is kept only if its exact goodput is within ``margin`` of ``g``. Returns (plan,
        goodput, number held)."""
        last = np.minimum(last, self.cap)
        changed = last != k
        if not changed.any():
            return k, g, 0
        table, ev = self.table, self.eval
        e_new, e_old = ev.expected(k), ev.expected(last)
        per_request = table.spec_request_ms * max(int(k.max()), int(last.max()))
        d_time = (k - last) * table.delta[s] + per_request * np.subtract(k > 0, last > 0, dtype=np.float64)
        is_held = changed & ((e_new - e_old) - g * d_time < margin * e_new)
        num_held = int(np.count_nonzero(is_held))
        if not num_held:
            return k, g, 0
        held = np.where(is_held, last, k)
        g_held = ev.one(held, s)
        if g_held < g * (1.0 - margin):
            return k, g, 0
        return held, g_held, num_held

    def intent(self, k: np.ndarray, lam: float, s: int, max_k: int) -> list[int] | None:
        """``[B]``: the k each request would take were it offered ``max_k`` drafts, for the engine's
        carry of the plan to later steps (engine/carry.py ``carry_plan``), where a request's offer
        (an n-gram match) moves from step to step: the drafts that pay at the plan's goodput ``lam``
        under scorer ``s`` — draft j while E[a^j] > λ·δ, as in :func:`improve`, and only if they pay
        for its share of the draft model — or its k, whichever is more. On an eager scorer only for a
        request held at its cap below ``max_k`` (one the plan left below its cap keeps its k: the
        search chose it). On a graph scorer (the plan in one of its graphs) for every request it
        drafts for: there the plan's k also fit the batch's tokens into a graph bucket (at N = 4,
        offered every draft, (7, 7, 7, 7) in 32 tokens rather than (8, 8, 8, 8) in 36), a fit the
        carry redoes for the offers it meets, within the plan's graph (:meth:`token_budget`;
        ``carry_plan`` drops the least valuable drafts above the plan's k beyond it), so a request
        alone with an offer takes its 8th draft. None when the intent is the plan."""
        is_graph = self.token_budget(k, s) is not None
        capped = (k >= self.cap) & (self.cap < max_k)
        if is_graph:  # a request the plan drafts for (one at k = 0 did not pay at all: it stays so)
            capped |= (k > 0) & (k < max_k)
        if not capped.any():
            return None
        idx = np.flatnonzero(capped)
        delta = self.table.delta[s, idx]  # [C]
        if self.powers.shape[1] >= max_k:  # the search's own (every offer max_k: a decide ahead)
            powers = self.powers[idx, :max_k]  # [C, max_k]
            kstar = (powers > lam * delta[:, None]).sum(-1)  # a prefix: E[a^j] falls with j
            gain = self.ecum[idx, np.maximum(kstar, 1)] - 1.0  # Σ_{j <= kstar} E[a^j]
        else:
            powers = acceptance_powers(self.mean[idx], self.std[idx], max_k)
            kstar = (powers > lam * delta[:, None]).sum(-1)
            gain = np.take_along_axis(np.cumsum(powers, axis=1), np.maximum(kstar - 1, 0)[:, None], 1)[:, 0]
        pays = gain - lam * (delta * kstar + self.table.spec_request_ms * max_k) > 0
        out = k.copy()
        out[idx] = np.maximum(k[idx], np.where(pays, kstar, 0))
        return None if is_graph and np.array_equal(out, k) else out.tolist()

    def token_budget(self, k: np.ndarray, s: int) -> int | None:
        """The token count of graph scorer ``s``'s bucket that plan ``k`` runs in (B + Σ k padded up);
        None for a scorer without graphs or a plan past its largest bucket (eager)."""
        b = self.buckets[s]
        if b is None:
            return None
        i = int(np.searchsorted(b, len(k) + int(k.sum())))
        return int(b[i]) if i < len(b) else None

    def can_probe(self, k) -> bool:
        """Whether the plan leaves at k = 0 a request that could draft."""
        return bool(((k == 0) & (self.cap > 0)).any())

    def probe(self, z: float, s: int):
        """The best plan for scorer ``s`` under optimistic acceptance a + z·std (point estimates)."""
        a = np.minimum(self.mean + z * self.std, 1.0 - 1e-6)
        powers = acceptance_powers(a, np.zeros_like(a), max(self.top, 1))
        ecum = expected_table(powers)
        return self._search(powers, PlanEvaluator(self.table, ecum, self.ctx))[0][s]

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
        return self.eval.components(k.tolist() if isinstance(k, np.ndarray) else k, s)

    def expected_at_mean(self, k) -> float:
        """Σ_i (1 − a_i^(k_i+1)) / (1 − a_i) at the posterior means (what every policy reports)."""
        a = np.minimum(self.mean, 1.0 - 1e-6)
        return float(((1.0 - a ** (k + 1)) / (1.0 - a)).sum())

    @staticmethod
    def as_list(k) -> list[int]:
        return k.tolist()

    def zeros(self):
        """The plan that drafts nothing."""
        return np.zeros_like(self.cap)
