"""``goodput``: per-request k and the scorer that maximise expected emitted tokens per predicted ms.

Terms: for request i with acceptance estimate a_i and k_i drafts, E_i(k_i) = (1 − a_i^(k_i+1)) /
(1 − a_i) tokens (:func:`expected_tokens`); T(k, scorer) = propose + score + verify + overhead ms
(:meth:`CostModels.predict`, which charges a draft model's max-k sequential forwards and a graph
scorer's bucket padding); goodput G = Σ_i E_i(k_i) / T.

Search (per scorer, for every batch cap K in 0..max_k at once, vectorised): Dinkelbach's method
for the ratio objective (Dinkelbach 1967, "On nonlinear fractional programming"): with λ the
current goodput, maximise Σ E_i − λ T over k; with T linearised (each draft of request i costs
δ_i ms, :meth:`CostModels.slopes`) that splits per request: the j-th draft is worth a_i^j tokens,
so take j while a_i^j > λ δ_i, and drop a request whose whole draft does not pay its share of the
draft model's per-request cost. Then λ ← G(k) with the exact prediction, until k settles. The best
K is then nudged to the graph bucket edges (fill the padding with the next-best drafts, or trim to
the smaller bucket), hysteresis applied, and k cut where the lookahead does not fit the free KV
blocks.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from specsched.policies.base import BatchView, Plan, Policy
from specsched.policies.cost_model import CostModels
from specsched.policies.fixed import make_plan, step_proposer
from specsched.policies.shapes import ShapeStats

_A_MAX = 1.0 - 1e-6  # acceptance cap (E stays finite)


@dataclass
class GoodputConfig:
    max_k: int = 8  # the most any request speculates (its own max_k caps it further)
    scorers: list[str] | None = None  # scorers to choose from; None = every scorer of the run
    scorer_margin: float = 0.05  # switch scorer only when predicted >5% better than last step's
    k_margin: float = 0.02  # change a request's k only when that gains >2% of its expected tokens
    acceptance_z: float = 1.0  # plan with a + z·std: optimism explores young estimates (< 0: caution)
    max_iters: int = 8  # Dinkelbach iterations

    def __post_init__(self) -> None:
        if self.max_k < 0:
            raise ValueError(f"policy goodput: max_k must be >= 0, got {self.max_k}")
        for name in ("scorer_margin", "k_margin"):
            if getattr(self, name) < 0:
                raise ValueError(f"policy goodput: {name} must be >= 0, got {getattr(self, name)}")
        if self.max_iters < 1:
            raise ValueError(f"policy goodput: max_iters must be >= 1, got {self.max_iters}")
        if self.scorers is not None and not self.scorers:
            raise ValueError("policy goodput: scorers must name at least one scorer (or be null for all)")


def expected_tokens_array(a: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Vectorised :func:`specsched.policies.acceptance.expected_tokens` for a < 1."""
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def batch_stats(k: np.ndarray, ctx: np.ndarray) -> ShapeStats:
    """Aggregates of the candidate plans ``k`` ``[..., B]`` over contexts ``ctx`` ``[B]``."""
    return ShapeStats(
        batch_size=k.shape[-1],
        num_tokens=k.shape[-1] + k.sum(-1),
        max_k=k.max(-1),
        num_spec_requests=(k > 0).sum(-1),
        num_draft_tokens=k.sum(-1),
        num_context_tokens=float(ctx.sum()),
        num_weighted_context_tokens=((k + 1) * ctx).sum(-1),
    )


class _Problem:
    """One step's search inputs for one scorer."""

    def __init__(self, costs: CostModels, scorer: str, proposer: str, a: np.ndarray, ctx: np.ndarray) -> None:
        self.costs, self.scorer, self.proposer, self.a, self.ctx = costs, scorer, proposer, a, ctx
        slopes = costs.slopes(scorer, proposer)
        self.delta = np.maximum(slopes.token_ms + slopes.context_ms * ctx, 1e-9)  # [B] ms per draft token
        self.spec_request_ms = max(slopes.spec_request_ms, 0.0)

    def goodput(self, k: np.ndarray) -> np.ndarray:
        cost = self.costs.predict_stats(self.scorer, self.proposer, batch_stats(k, self.ctx))
        return expected_tokens_array(self.a, k).sum(-1) / np.maximum(cost.total_ms, 1e-9)

    def search(self, caps: np.ndarray, max_iters: int) -> tuple[np.ndarray, np.ndarray]:
        """Best k ``[R, B]`` and its exact goodput ``[R]`` for each cap row of ``caps`` ``[R, B]``.

        Dinkelbach on the linearised time T(k) = T_R(0) + Σ_i (k_i δ_i + [k_i > 0] c_R), where
        T_R(0) is the exact prediction of a step with batch max k = K_R but no drafts (it holds the
        draft model's per-forward cost) and c_R the draft cost per drafting request at max k K_R."""
        num_rows, batch = caps.shape
        row_k = caps.max(-1)  # [R]
        zeros = np.zeros(num_rows, dtype=np.int64)
        ctx_sum = float(self.ctx.sum())
        base_stats = ShapeStats(batch, batch + zeros, row_k, zeros, zeros, ctx_sum, ctx_sum + zeros)
        base = self.costs.predict_stats(self.scorer, self.proposer, base_stats).total_ms  # [R]
        fixed = (self.spec_request_ms * row_k)[:, None]  # [R, 1]
        inv_log_a = 1.0 / np.log(np.maximum(self.a, 1e-12))
        log_delta = np.log(self.delta)
        draft_worth = self.a / (1.0 - self.a)  # Σ_{j<=k} a^j = draft_worth · (1 − a^k)
        lam = np.full((num_rows, 1), batch / max(float(base[0]), 1e-9))  # [R, 1] current goodput
        k = np.zeros_like(caps)
        for _ in range(max_iters):
            # take draft j while a^j > λ δ_i, i.e. j < log(λ δ_i) / log(a_i)
            n = np.ceil((np.log(lam) + log_delta) * inv_log_a) - 1.0
            new_k = np.minimum(np.maximum(n, 0.0), caps).astype(np.int64)
            a_pow_k = self.a**new_k
            gain = draft_worth * (1.0 - a_pow_k) - lam * (new_k * self.delta + fixed)
            new_k = np.where(gain > 0, new_k, 0)
            if np.array_equal(new_k, k):
                break
            k = new_k
            step_ms = base + (k * self.delta + fixed * (k > 0)).sum(-1)
            lam = (expected_tokens_array(self.a, k).sum(-1) / np.maximum(step_ms, 1e-9))[:, None]
        return k, self.goodput(k)

    def fit_buckets(self, k: np.ndarray, g: float, cap: np.ndarray) -> tuple[np.ndarray, float]:
        """For a graph scorer: try filling the bucket padding with the next-best drafts (up to
        ``cap``) and trimming down to the smaller bucket; the best of the three by exact goodput."""
        best_k, best_g = k, g
        buckets = self.costs.graph_buckets.get(self.scorer)
        tokens = len(k) + int(k.sum())
        if buckets is None or tokens > buckets[-1]:
            return best_k, best_g
        idx = int(np.searchsorted(buckets, tokens))
        free, excess = int(buckets[idx]) - tokens, tokens - (int(buckets[idx - 1]) if idx > 0 else 0)
        j = np.arange(1, int(max(cap.max(), k.max(), 1)) + 1)[None, :]
        a_pow = self.a[:, None] ** j  # [B, J] worth of draft j of request i
        # grow adds the most valuable missing drafts, trim drops the least valuable present ones;
        # both keep each request's drafts a prefix, since a^j falls with j
        grow_mask = (j > k[:, None]) & (j <= cap[:, None])
        trim_mask = j <= k[:, None]
        for mask, count, sign in ((grow_mask, free, 1), (trim_mask, excess if idx > 0 else 0, -1)):
            count = min(count, int(mask.sum()))
            if count <= 0:
                continue
            value = np.where(mask, sign * a_pow, -np.inf).ravel()
            rows = np.unravel_index(np.argsort(-value, kind="stable")[:count], a_pow.shape)[0]
            cand = k + sign * np.bincount(rows, minlength=len(k))
            g = float(self.goodput(cand))
            if g > best_g:
                best_k, best_g = cand, g
        return best_k, best_g


def fit_kv_blocks(k: np.ndarray, ctx: np.ndarray, a: np.ndarray, num_free_blocks: int, block_size: int):
    """Cut k until the lookahead fits: request i holds ceil(ctx_i / bs) blocks and needs
    ceil((ctx_i + k_i) / bs). Each cut frees one block from the request that loses the fewest
    expected tokens doing so (Σ a^j over the drafts dropped). Returns (k, number of cuts)."""
    k = k.copy()
    held = -(-ctx.astype(np.int64) // block_size)
    need = -(-(ctx.astype(np.int64) + k) // block_size) - held
    over = int(need.sum()) - num_free_blocks
    num_cuts, heap = 0, []

    def push(i: int) -> None:
        if k[i] > 0 and need[i] > 0:  # a lookahead inside held blocks frees nothing when cut
            target = max(0, int((held[i] + need[i] - 1) * block_size - ctx[i]))  # one block fewer
            loss = sum(float(a[i]) ** j for j in range(target + 1, int(k[i]) + 1))
            heapq.heappush(heap, (loss, i, target))

    if over > 0:
        for i in range(len(k)):
            push(i)
    while over > 0 and heap:
        _, i, target = heapq.heappop(heap)
        k[i], need[i], over, num_cuts = target, need[i] - 1, over - 1, num_cuts + 1
        push(i)
    return k, num_cuts


class GoodputPolicy(Policy):
    """Maximises Σ E_i(k_i) / predicted step time over per-request k and the scorer (see module)."""

    name = "goodput"
    config_cls = GoodputConfig

    def __init__(self, config: GoodputConfig | None = None) -> None:
        self.config = config or GoodputConfig()
        self._last_scorer: str | None = None

    def decide(self, view: BatchView, costs: CostModels | None) -> Plan:
        cfg = self.config
        if costs is None:
            raise ValueError("policy goodput needs cost models (costs is None)")
        scorers = [s for s in (cfg.scorers or view.scorers) if s in view.scorers]
        if not scorers:
            raise ValueError(
                f"policy goodput: none of {cfg.scorers} is available (available: {view.scorers})"
            )
        if not view.requests:
            return Plan(
                [], self._last_scorer if self._last_scorer in scorers else scorers[0], self.name, 0.0, 0.0
            )
        reqs = view.requests
        # an upper confidence bound (Auer et al. 2002, UCB1's optimism): a request whose estimate
        # is still young is tried with drafts, else k = 0 would never tell us its acceptance
        a = np.clip([r.acceptance + cfg.acceptance_z * r.acceptance_std for r in reqs], 0.0, _A_MAX)
        ctx = np.array([r.context_len for r in reqs], dtype=np.float64)
        cap = np.clip([min(r.max_k, cfg.max_k) for r in reqs], 0, None).astype(np.int64)
        caps = np.minimum(np.arange(int(cap.max()) + 1)[:, None], cap[None, :])  # [K+1, B]
        proposer = step_proposer(view)

        found = {}  # scorer -> (problem, k, goodput, goodput with k = 0, best goodput with k > 0)
        for s in scorers:
            problem = _Problem(costs, s, proposer, a, ctx)
            ks, gs = problem.search(caps, cfg.max_iters)
            best = int(np.argmax(gs))
            k, g = problem.fit_buckets(ks[best], float(gs[best]), cap)
            found[s] = (problem, k, g, float(gs[0]), float(gs[1:].max()) if len(gs) > 1 else None)
        ranked = sorted(found, key=lambda s: -found[s][2])
        chosen, is_held = ranked[0], False
        last = self._last_scorer
        if (
            last in found
            and chosen != last
            and found[chosen][2] <= found[last][2] * (1.0 + cfg.scorer_margin)
        ):
            chosen, is_held = last, True
        problem, k, g, g_off, g_spec = found[chosen]

        num_k_held = 0
        if cfg.k_margin > 0:
            k, g, num_k_held = self._hold_k(problem, k, g, np.array([r.last_k for r in reqs]), cap)
        k, num_cuts = fit_kv_blocks(k, ctx, a, view.num_free_blocks, view.block_size)

        runner_up = next((s for s in ranked if s != chosen), None)
        if int(cap.max()) == 0:
            reason = "no request can speculate (every max_k is 0)"
        elif not k.any():
            spec = f"{g_spec:.4g}" if g_spec is not None else "n/a"
            reason = f"speculation off: k=0 predicts {g_off:.4g} tokens/ms, the best k>0 {spec}"
            if num_cuts:
                reason += f"; {num_cuts} lookahead blocks cut for lack of free KV blocks"
        else:
            reason = f"speculating: {g:.4g} tokens/ms vs {g_off:.4g} with k=0"
        info = {
            "reason": reason,
            "goodput": g,
            "goodput_k0": g_off,
            "scorer_goodput": {s: found[s][2] for s in ranked},
            "runner_up": runner_up,
            "runner_up_goodput": found[runner_up][2] if runner_up else None,
            "is_scorer_held": is_held,
            "num_k_held": num_k_held,
            "num_kv_cuts": num_cuts,
        }
        self._last_scorer = chosen
        return make_plan(self.name, view, costs, [int(x) for x in k], chosen, info)

    def _hold_k(self, problem: _Problem, k: np.ndarray, g: float, last: np.ndarray, cap: np.ndarray):
        """Keep a request's last k unless changing it gains more than ``k_margin`` of its expected
        tokens, valued at the current goodput (ΔE − G·ΔT, ΔT linearised); last k is first clipped to
        the request's cap. The held plan is kept only if its exact goodput is within ``k_margin``."""
        last = np.minimum(last, cap)
        if not (last != k).any():
            return k, g, 0
        a = problem.a
        e_new, e_old = expected_tokens_array(a, k), expected_tokens_array(a, last)
        per_request = problem.spec_request_ms * max(int(k.max()), int(last.max()))
        d_time = (k - last) * problem.delta + per_request * ((k > 0) * 1.0 - (last > 0) * 1.0)
        net = (e_new - e_old) - g * d_time
        hold = (last != k) & (net < self.config.k_margin * e_new)
        if not hold.any():
            return k, g, 0
        held = np.where(hold, last, k)
        g_held = float(problem.goodput(held))
        if g_held < g * (1.0 - self.config.k_margin):
            return k, g, 0
        return held, g_held, int(hold.sum())
