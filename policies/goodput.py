"""``goodput``: per-request k and the scorer that maximise expected emitted tokens per predicted ms.

For request i with acceptance posterior a_i and k_i drafts the step is expected to emit E_i(k_i)
tokens (Leviathan et al. 2023, averaged over the posterior: :mod:`specsched.policies.goodput_search`);
T(k, scorer) = propose + score + verify + overhead ms from the online cost models (a draft model's
max-k sequential forwards, a graph scorer's bucket padding). The policy picks the plan and scorer
with the largest G = Σ_i E_i / T: every uniform plan (k_i = min(K, cap_i), K = 0..max k: exact at
batch 1), then Dinkelbach steps for per-request k, the graph buckets' padding filled or trimmed,
hysteresis so that neither scorer nor k flips at a threshold, and the lookahead cut to the free KV
blocks. K = 0 (speculation off) is always a candidate.

Learning while deciding (the cost models and acceptance estimates only see what the policy does):
- *Probes*: plans use the posterior, not an optimistic bound, so a request left at k = 0 is never
  observed and its estimate never moves. On the first decide, then after 8, 16, 32, … decides
  (doubling up to ``max_probe_interval``), while the plan leaves at k = 0 some request that could
  draft, the step is planned with a_i + ``acceptance_z``·std_i instead (UCB1's optimism, Auer et al.
  2002): a young or stale estimate gets a look, at a cost that shrinks geometrically.
- *Dither*: every ``dither_interval`` decides the drafting requests take k + 1 or k − 1
  (alternating) unless that is predicted more than ``dither_tolerance`` worse. A policy that holds
  one k shows the cost model one point of the cost-vs-k line, whose slope (which decides k) then
  stays at the prior's guess (persistent excitation; Åström & Wittenmark, *Adaptive Control*, §2.4).
- *Young scorers*: a scorer predicted better whose cost model has seen fewer than
  ``min_scorer_steps`` steps is not held off by the scorer hysteresis, so a prior cannot hide it.
- *Tries* (while probes and dither are off): every ``try_interval`` decides one step runs, in turn,
  the runner-up scorer's best plan or the plan dithered, if predicted within ``try_tolerance`` of the
  plan. A cost is learnt only where the policy steps, so a plan mispriced by its start-up profile is
  otherwise never run again: on the H100 (2026-12-06, 7B pair, batch 4, a = 0.3) the profile priced
  batch expansion's 8-row graph 0.33 ms (6 %) over what it took in every timed step, and goodput kept
  the MQA graph at k = 2 (0.724 tokens/ms) beside batch expansion at k = 1 (0.748, the oracle). A try
  costs at most ``try_tolerance`` of one step in ``try_interval``.

*Pruning*: a decide searches only the scorers still in contention
(:mod:`specsched.policies.goodput_scope`).

Probes and dither stop once the acceptance posteriors are tight and the cost models predict the
measured steps without bias, and resume when either grows again
(:class:`~specsched.policies.goodput_explore.ExplorationSwitch`).

A step where every request gets k = 0 is a plain decode: it runs on the scorer predicted cheapest
for one (:func:`~specsched.policies.goodput_explore.decode_scorer`; a young decode graph the seeds
rank alike is tried), not on the one the hysteresis kept from the speculative steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from specsched.policies.base import BatchView, Plan, Policy
from specsched.policies.cost_model import CostModels
from specsched.policies.fixed import step_proposer
from specsched.policies.goodput_explore import ExplorationSwitch, decode_scorer
from specsched.policies.goodput_scope import SearchScope
from specsched.policies.goodput_search import BatchProblem
from specsched.policies.goodput_small import MAX_EXACT_BATCH, SmallProblem
from specsched.policies.run_cost import weigh_run


@dataclass
class GoodputConfig:
    max_k: int = 8  # the most any request speculates (its own max_k caps it further)
    scorers: list[str] | None = None  # scorers to choose from; None = every scorer of the run
    scorer_margin: float = 0.02  # switch scorer only when predicted >2% better than last step's
    k_margin: float = 0.01  # change a request's k only when that gains >1% of its expected tokens
    optimism: float = 0.0  # plan with a + optimism·std (the posterior's mean at 0)
    acceptance_z: float = 1.0  # probe steps plan with a + z·std (0: never probe)
    probe_interval: int = 8  # decides between the first two probes; doubles after each
    max_probe_interval: int = 256
    min_scorer_steps: int = 8  # a scorer whose cost model has seen fewer steps is not held off
    dither_interval: int = 8  # every this many decides, k ± 1 for the drafting requests (0: never)
    dither_tolerance: float = 0.03  # ... unless predicted worse than the plan by more than this
    decode_try_tolerance: float = 0.05  # k = 0 steps try a scorer priced this close to the best
    explore_stop_std: float = 0.05  # probes/dither stop once the mean posterior sd is at most this
    explore_stop_error: float = 0.05  # ... and the step-ms prediction's running |bias| at most this
    explore_restart: float = 2.0  # ... and restart when either exceeds this times its threshold
    explore_min_steps: int = 32  # decides of exploration at least, from the start or a restart
    try_interval: int = 16  # exploration off: every this many decides a try (module docstring; 0: never)
    try_tolerance: float = 0.05  # ... of a plan predicted at most this much worse than the chosen
    max_iters: int = 2  # Dinkelbach iterations (batch > 1; a third gained <0.02 % at batch 64, H200 log)
    # search only the scorers whose best goodput at the last full search was at least this share of
    # the best one's (0: every scorer on every decide); a full search every full_search_interval decides
    prune_below: float = 0.5
    full_search_interval: int = 16
    # plan with two acceptance rates per request, the first draft's and a later one's given its
    # predecessor (policies/acceptance_stages.py; n-gram drafts are copied spans), instead of one;
    # the default since 2026-12-07: it drafted more tokens per request-step than one rate in every
    # live A/B cell (docs/benchmarks.md, "One acceptance rate cuts the copied spans")
    staged_acceptance: bool = True
    # batches of 2 to this many requests are searched in plain Python (policies/goodput_small.py; the
    # numpy search's per-call overhead dominated there), larger ones with numpy; both decide alike
    plain_search_max_batch: int = MAX_EXACT_BATCH

    def __post_init__(self) -> None:
        if self.max_k < 0:
            raise ValueError(f"policy goodput: max_k must be >= 0, got {self.max_k}")
        for name in ("scorer_margin", "k_margin", "optimism", "acceptance_z", "dither_tolerance",
                     "decode_try_tolerance", "try_tolerance", "explore_stop_std",
                     "explore_stop_error"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"policy goodput: {name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.plain_search_max_batch <= MAX_EXACT_BATCH:
            raise ValueError(
                f"policy goodput: plain_search_max_batch must be in [1, {MAX_EXACT_BATCH}] (1: numpy from "
                f"batch 2; above {MAX_EXACT_BATCH} numpy's pairwise sums round apart), got "
                f"{self.plain_search_max_batch}"
            )
        if self.explore_restart < 1:
            raise ValueError(f"policy goodput: explore_restart must be >= 1, got {self.explore_restart}")
        for name in ("dither_interval", "min_scorer_steps", "explore_min_steps", "try_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"policy goodput: {name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.prune_below < 1:
            raise ValueError(f"policy goodput: prune_below must be in [0, 1), got {self.prune_below}")
        for name in ("max_iters", "probe_interval", "full_search_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"policy goodput: {name} must be >= 1, got {getattr(self, name)}")
        if self.max_probe_interval < self.probe_interval:
            raise ValueError(
                f"policy goodput: max_probe_interval ({self.max_probe_interval}) must be >= "
                f"probe_interval ({self.probe_interval})"
            )
        if self.scorers is not None and not self.scorers:
            raise ValueError("policy goodput: scorers must name at least one scorer (or be null for all)")


class GoodputPolicy(Policy):
    """Maximises Σ E_i(k_i) / predicted step time over per-request k and the scorer (see module)."""

    name = "goodput"
    config_cls = GoodputConfig

    is_plan_ahead_safe = True  # reads posteriors and cost models, which move slowly

    def __init__(self, config: GoodputConfig | None = None) -> None:
        self.config = config or GoodputConfig()
        self._last_scorer: str | None = None
        self._num_decides = 0
        self._next_probe = 0  # decide count after which the next probe may come
        self._probe_interval = self.config.probe_interval
        self._dither = 1  # direction of the next dither
        self._num_tries = 0  # tries so far: even ones try the runner-up scorer, odd ones dither
        self._is_fresh_k = False  # last step's k was a probe or dither: no k hysteresis against it
        self.scope = SearchScope(self.config)  # each decide's search, over the scorers in contention
        self._k0_scorer: str | None = None  # a plain decode's scorer at the last search of every scorer
        self._is_run = False  # the last plan was a run of plain steps taken over speculation
        self._run_regret_ms = 0.0  # ms the runs passed up since speculation last led would have saved
        cfg = self.config
        self.exploration = ExplorationSwitch(
            cfg.explore_stop_std, cfg.explore_stop_error, cfg.explore_restart, cfg.explore_min_steps
        )

    def decide(self, view: BatchView, costs: CostModels | None) -> Plan:
        cfg = self.config
        if costs is None:
            raise ValueError("policy goodput needs cost models (costs is None)")
        scorers = [s for s in (cfg.scorers or view.scorers) if s in view.scorers]
        if not scorers:
            raise ValueError(
                f"policy goodput: none of {cfg.scorers} is available (available: {view.scorers})"
            )
        reqs = view.requests
        if not reqs:
            last = self._last_scorer if self._last_scorer in scorers else scorers[0]
            return Plan([], last, self.name, 0.0, 0.0)
        self._num_decides += 1
        prob, last_k, spreads, scorers = self.scope.problem(view, costs, scorers, self._num_decides)
        g_scorers = prob.best_goodput

        # scorer, with hysteresis: keep last step's unless another is better by scorer_margin, or
        # better at all while its cost model has seen few steps (else a prior could hide it for good)
        chosen = max(range(len(scorers)), key=g_scorers.__getitem__)
        last = scorers.index(self._last_scorer) if self._last_scorer in scorers else None
        is_held = (
            last is not None
            and last != chosen
            and g_scorers[chosen] <= g_scorers[last] * (1.0 + cfg.scorer_margin)
            and costs.model("score", scorers[chosen]).num_updates >= cfg.min_scorer_steps
        )
        if is_held:
            chosen = last
        k = prob.best_k[chosen]
        g = g_scorers[chosen]
        num_k_held = 0
        if cfg.k_margin > 0 and prob.top > 0 and not self._is_fresh_k:
            k, g, num_k_held = prob.hold(k, g, last_k, chosen, cfg.k_margin)
        is_probe = is_dither = False
        spread = sum(spreads) / len(spreads) if spreads else None
        error = costs.prediction_error(scorers[chosen], signed=True)
        error = None if error is None else abs(error)
        if self.exploration.update(spread, error):  # restart: probe now, then at doubling intervals again
            self._next_probe, self._probe_interval = 0, cfg.probe_interval
        is_exploring = self.exploration.is_on
        if (
            is_exploring
            and prob.top > 0
            and cfg.acceptance_z > 0
            and self._num_decides > self._next_probe
            and prob.can_probe(k)
        ):
            k, is_probe = prob.probe(cfg.acceptance_z, chosen), True  # someone could draft but does not
            self._next_probe = self._num_decides + self._probe_interval
            self._probe_interval = min(2 * self._probe_interval, cfg.max_probe_interval)
        elif is_exploring and cfg.dither_interval and self._num_decides % cfg.dither_interval == 0:
            dithered, self._dither = prob.dither(k, g, self._dither, chosen, cfg.dither_tolerance)
            if dithered is not None:
                k, is_dither = dithered, True
        self._last_scorer = scorers[chosen]  # the speculative choice, which the hysteresis holds
        is_try = False
        is_try_due = cfg.try_interval and self._num_decides % cfg.try_interval == 0
        if is_try_due and not is_exploring and prob.top > 0:
            tried = self._try(prob, k, g, chosen, g_scorers)
            if tried is not None:
                (k, chosen), is_try = tried, True
        self._is_fresh_k = is_probe or is_dither or is_try
        k, num_cuts = prob.fit_kv(k, view.num_free_blocks, view.block_size)
        is_decode = is_decode_try = False
        k_list = prob.as_list(k)
        is_spec = any(k_list)
        k0_scorer = scorers[chosen]
        if len(scorers) > 1:  # a plain decode step's scorer (also the hint for a carry that drafts nothing)
            ctx = [r.context_len for r in reqs]
            k0, is_k0_try = decode_scorer(
                costs, scorers, prob.goodput_k0, ctx, cfg.min_scorer_steps, cfg.decode_try_tolerance
            )
            k0_scorer = scorers[k0]
            if not is_spec:
                chosen, is_decode_try, is_decode = k0, is_k0_try, True
        if self.scope.last_full == self._num_decides or self._k0_scorer not in scorers:  # searched all
            self._k0_scorer = k0_scorer
        else:  # a pruned search: a carry that drafts nothing runs on the last full search's choice
            k0_scorer = self._k0_scorer

        cost = prob.components(k, chosen)
        g_plan = prob.goodput(k, chosen) if is_probe or is_dither or is_try or num_cuts or is_decode else g
        run = None
        if view.decode_steps > 1:  # a plan with every k = 0 runs several plain steps: weigh that
            ctx = [r.context_len for r in reqs]
            g_spec = g_plan if is_spec and not (is_probe or is_dither or is_try) else None  # exploring
            switch_ms = costs.catchup_ms(step_proposer(view))  # what the return to drafting costs
            run = weigh_run(
                costs, k0_scorer, ctx, view.decode_steps, g_spec, self._is_run, cfg.scorer_margin,
                switch_ms, self._run_regret_ms,
            )  # fmt: skip
            if g_spec is not None:  # a plan that drafts nothing leaves the hysteresis as it was
                self._is_run, self._run_regret_ms = run.is_taken, run.regret_ms
            if run.is_taken:
                chosen, is_spec, is_decode, is_decode_try = scorers.index(k0_scorer), False, True, False
                k = prob.zeros()
                k_list, cost, g_plan = prob.as_list(k), prob.components(k, chosen), run.goodput
        ranked = sorted(range(len(scorers)), key=lambda s: -g_scorers[s])
        runner_up = next((s for s in ranked if s != chosen), None)
        g_off = prob.goodput_k0[chosen]
        reason = _reason(prob.top, is_spec, g_plan, g_off, num_cuts, is_probe)
        if is_try and is_spec:
            reason = f"try (runner-up plan, its cost measured): {g_plan:.4g} tokens/ms, the plan {g:.4g}"
        if run is not None and run.is_taken:
            reason = (
                f"run of {view.decode_steps} plain steps: {run.goodput:.4g} tokens/ms, speculating "
                f"{run.spec_goodput:.4g}"
            )
        info = {
            "reason": reason,
            "goodput": g_plan,
            "goodput_k0": g_off,
            "scorer_goodput": {scorers[s]: g_scorers[s] for s in ranked},
            "runner_up": scorers[runner_up] if runner_up is not None else None,
            "runner_up_goodput": g_scorers[runner_up] if runner_up is not None else None,
            "is_scorer_held": bool(is_held),
            "num_k_held": num_k_held,
            "num_kv_cuts": num_cuts,
            "is_probe": is_probe,
            "is_dither": is_dither,
            "is_try": is_try,
            "is_exploring": is_exploring,
            "explore_spread": spread,
            "explore_error": error,
            "is_decode_scorer": is_decode,
            "is_decode_try": is_decode_try,
            "k0_scorer": k0_scorer,  # engine/carry.carry_plan: the scorer if a carry drafts nothing
            "num_scorers_searched": len(scorers),
            # the posterior means the plan was made with (batch order), for comparing a live log's
            # decisions with a replay's (docs/benchmarks.md, 2026-12-07: live goodput drafted less)
            "acceptance": [r.acceptance for r in reqs],
        }
        for name in ("propose_ms", "score_ms", "verify_ms", "overhead_ms"):
            info[f"predicted_{name}"] = cost[name]
        if isinstance(prob, BatchProblem | SmallProblem) and not (run is not None and run.is_taken):
            intent = prob.intent(k, g_plan, chosen, cfg.max_k)  # what a carry offers more drafts
            if intent is not None:
                info["k_intent"] = intent
                budget = prob.token_budget(k, chosen)  # a carry of the intent stays in the plan's graph
                if budget is not None:
                    info["token_budget"] = budget
        # expected tokens at the posterior means, as every policy's plan reports them (make_plan)
        expected, total_ms = prob.expected_at_mean(k), cost["total_ms"]
        if run is not None:
            info["run_goodput"], info["is_run"] = run.goodput, run.is_taken
            if switch_ms > 0:  # the rent-or-buy account of entering runs (policies/run_cost.py)
                info["run_switch_ms"], info["run_regret_ms"] = switch_ms, run.regret_ms
            if not is_spec:  # the engine runs a plan that drafts nothing as a run: its ms and tokens
                expected, total_ms = float(len(reqs) * view.decode_steps), run.ms
        return Plan(
            k_list, scorers[chosen], self.name, total_ms, expected, info, is_one_step=is_probe or is_try
        )

    def _try(self, prob, k, g: float, chosen: int, g_scorers: list[float]):
        """A try's (k, scorer index) (module docstring, *Tries*), or None when this turn's candidate
        is none or predicted worse than ``g`` by more than ``try_tolerance``: even tries the runner-up
        scorer's best plan, odd ones ``k`` dithered (the turn passes either way)."""
        cfg, turn = self.config, self._num_tries
        self._num_tries += 1
        if turn % 2 == 1:
            dithered, self._dither = prob.dither(k, g, self._dither, chosen, cfg.try_tolerance)
            return None if dithered is None else (dithered, chosen)
        others = [s for s in range(len(g_scorers)) if s != chosen]
        if not others:
            return None
        best = max(others, key=g_scorers.__getitem__)
        if g_scorers[best] < g * (1.0 - cfg.try_tolerance) or not any(prob.as_list(prob.best_k[best])):
            return None
        return prob.best_k[best], best


def _reason(top: int, is_spec: bool, g: float, g_off: float, num_cuts: int, is_probe: bool) -> str:
    if top == 0:
        return "no request can speculate (every max_k is 0)"
    if not is_spec:
        reason = f"speculation off: k=0 predicts {g_off:.4g} tokens/ms, at least the best k>0 plan"
        if num_cuts:
            reason += f"; {num_cuts} lookahead blocks cut for lack of free KV blocks"
        return reason
    if is_probe:
        return f"probe: planned with optimistic acceptance (mean + z·std): {g:.4g} tokens/ms"
    return f"speculating: {g:.4g} tokens/ms vs {g_off:.4g} with k=0"
