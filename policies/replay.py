"""Offline replay: re-run the step loop's decisions of a recorded run under other policies.

A run is read by :mod:`specsched.policies.replay_log` (whose docstring defines output indices and
match bits) and its match bits completed by :mod:`specsched.policies.replay_bits` (the imputation).

The replay (:func:`simulate`) batches continuously: requests join in their first-step order while
fewer than ``scheduler.max_num_seqs`` run, and leave at their recorded output length. Each decode
step builds a :class:`BatchView`, asks the policy, reads the match bits to get each request's
accepted count, and charges the step the cost model's predicted ms; the cost model is refitted from
the run's measured step timings (:func:`refit_costs`). A plan that drafts nothing where the engine
would run several plain forwards back to back runs them as one step of that many tokens a request
(the run's scheduler options: :mod:`specsched.policies.replay_runs`). Prefill steps are taken from
the recording, with their measured time, for every policy alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specsched.policies.acceptance import AcceptanceEstimator
from specsched.policies.base import BatchView, Policy, RequestView
from specsched.policies.cost_model import CostModels
from specsched.policies.registry import POLICIES, build_policy
from specsched.policies.replay_bits import MatchBits, complete_bits
from specsched.policies.replay_clients import Arrivals
from specsched.policies.replay_costs import costs_for, decide_spill_ms, record_ms, refit_costs
from specsched.policies.replay_log import RecordedRequest, RecordedRun, RunSettings
from specsched.policies.replay_runs import RunRules, run_length
from specsched.policies.run_cost import plain_stats
from specsched.policies.shapes import StepShape

_UNBOUNDED = 1 << 30


@dataclass
class StepTrace:
    """One decode step of a row (for the plots)."""

    batch_size: int
    mean_k: float
    scorer: str
    predicted_ms: float
    measured_ms: float | None = None


@dataclass
class PolicyResult:
    """One row of the replay table."""

    label: str
    source: str  # "recorded" (the log as it is) | "replayed"
    num_steps: int = 0  # decode steps (a run of plain steps is one, as in the log)
    num_run_steps: int = 0  # the plain forwards of those runs
    num_prefill_steps: int = 0
    num_admitted: int = 0  # requests the replay ran (``simulate``'s ``window_ms``: sent again, or not sent)
    num_tokens: int = 0  # output tokens, the prefills' first tokens included
    num_decode_tokens: int = 0
    num_request_steps: int = 0  # (request, decode step) pairs
    num_drafts: int = 0
    predicted_ms: float = 0.0  # decode steps predicted + prefill steps measured
    measured_ms: float | None = None  # recorded row only
    scorer_steps: dict[str, int] = field(default_factory=dict)
    num_bits_read: int = 0
    num_bits_imputed: int = 0
    error: str | None = None
    trace: list[StepTrace] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return self.num_decode_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / (self.predicted_ms / 1e3) if self.predicted_ms > 0 else 0.0

    @property
    def measured_tokens_per_s(self) -> float | None:
        return self.num_tokens / (self.measured_ms / 1e3) if self.measured_ms else None

    @property
    def mean_k(self) -> float:
        return self.num_drafts / self.num_request_steps if self.num_request_steps else 0.0

    @property
    def imputed_share(self) -> float | None:
        return self.num_bits_imputed / self.num_bits_read if self.num_bits_read else None


def _base_result(run: RecordedRun, label: str, source: str, costs: CostModels) -> PolicyResult:
    prefill = run.prefill_steps
    return PolicyResult(
        label, source, num_prefill_steps=len(prefill), predicted_ms=sum(map(costs.step_ms, prefill))
    )


def recorded_result(run: RecordedRun, costs: CostModels) -> PolicyResult:
    """The log as it is: measured total, and the refitted model's prediction for the same steps."""
    label = policy_label(run.settings.policy) if run.settings.policy else "?"
    res = _base_result(run, label, "recorded", costs)
    res.measured_ms = sum(map(costs.step_ms, run.steps))
    last: set[str] | None = None
    for rec in run.decode_steps:
        ks = [r.k for r in rec.requests]
        pred = record_ms(costs, rec, run.settings.proposer)
        if costs.churn is not None:  # as the replay charges its steps
            ids = {q.request_id for q in rec.requests}
            pred, last = costs.churn.charged(pred, last, ids), ids
        res.predicted_ms += pred
        res.trace.append(StepTrace(len(ks), sum(ks) / len(ks), rec.scorer, pred, costs.step_ms(rec)))
        res.num_steps += 1
        res.num_run_steps += rec.num_decode_steps if rec.num_decode_steps > 1 else 0
        res.num_request_steps += len(ks)
        res.num_drafts += sum(ks)
        res.scorer_steps[rec.scorer] = res.scorer_steps.get(rec.scorer, 0) + 1
    res.num_tokens = sum(r.output_len for r in run.requests)
    res.num_decode_tokens = sum(max(r.output_len - 1, 0) for r in run.requests)
    return res


def policy_label(cfg: Mapping | None) -> str:
    """``fixed k=3``: the policy's name (or ``_target_``) and the options that differ from its defaults."""
    if not cfg:
        return "?"
    options = dict(cfg)
    name = str(options.pop("name", None) or options.pop("_target_", "?"))
    options.pop("_target_", None)
    cls = POLICIES.get(name)
    defaults = vars(cls.config_cls()) if cls is not None and hasattr(cls, "config_cls") else {}
    shown = [f"{k}={v}" for k, v in options.items() if k not in defaults or defaults[k] != v]
    return " ".join([name, *shown])


@dataclass
class _Live:
    index: int  # into run.requests
    req: RecordedRequest
    s: int = 0  # output index of the step's input token (output tokens so far - 1)
    last_k: int = 0
    last_accepted: int = 0


def _offer(live: _Live, settings: RunSettings, proposer: str) -> int:
    """Drafts the proposer has on offer at the request's index (the engine's peek): an n-gram's match
    length as recorded there (else unknown: ``max_k``), a draft model's ``max_k``."""
    if proposer == "none":
        return 0
    if proposer == "ngram":
        return live.req.recorded_k.get(live.s, settings.max_k)
    return settings.max_k


def _max_k(live: _Live, settings: RunSettings, proposer: str) -> int:
    cap = min(settings.max_k, live.req.output_len - live.s - 2)  # leave the last token to the target
    return max(min(cap, _offer(live, settings, proposer)), 0)


def _plain_forward_ms(costs: CostModels, scorers: Sequence[str], ctx: list[int]) -> float:
    """A plain forward's predicted scoring ms on the cheapest scorer (the engine measures its own)."""
    stats = plain_stats(ctx)
    return min(costs.predict_stats(s, "none", stats).score_ms for s in scorers)


def simulate(
    run: RecordedRun,
    bits: MatchBits,
    policy: Policy,
    costs: CostModels,
    label: str,
    scorers: Sequence[str] | None = None,
    closed_loop: bool = False,
    segments: Sequence[int] | None = None,
    think_ms: Sequence[float] | None = None,
    window_ms: Sequence[float] | None = None,
    proposer: str | None = None,
    runs: RunRules | None = None,
) -> PolicyResult:
    """Replay the run's requests under ``policy`` (see the module docstring). ``proposer`` ("none":
    a non-speculative config replayed on a drafting log) and ``runs`` (the runs of plain steps,
    policies/replay_runs.py) replace the run's own. Who joins when —
    ``closed_loop`` (each client one request at a time), ``segments`` (busy periods), ``think_ms``
    (each client's round trips) and ``window_ms`` (each period's clients send for as long as they did
    live, their requests sent again or not at all): :mod:`specsched.policies.replay_clients`. With
    windows each request sent costs its share of the run's measured prefill ms, in the clock and in
    the result, in place of the run's prefills. Raises ``ValueError`` when the policy cannot run here
    (e.g. it names a scorer that ``scorers`` lacks)."""
    st = run.settings
    scorers = list(scorers or st.scorers)
    proposer, rules = proposer or st.proposer, runs or st.runs
    res = _base_result(run, label, "replayed", costs)
    acceptance = AcceptanceEstimator()
    prefill = sum(map(costs.step_ms, run.prefill_steps))
    each = prefill / len(run.requests) if run.requests else 0.0  # used with windows only
    arrivals = Arrivals(run.requests, closed_loop, segments, think_ms, window_ms, each)
    running: list[_Live] = []
    churn = costs.churn  # ChurnResidual | None: what a change of the batch adds to a step
    last_ids: set[str] | None = None  # the requests of the last simulated step
    while arrivals.has_work or running:
        for i in arrivals.admit(st.max_num_seqs - len(running), is_drained=not running):
            live = _Live(i, run.requests[i])
            res.num_tokens += min(live.req.output_len, 1)
            if live.req.output_len > 1:
                running.append(live)
        if not running:
            arrivals.wait()  # nobody ready: the clients' round trips (idle, as live)
            continue
        ctx = [live.req.prompt_len + live.s + 1 for live in running]
        held = sum(-(-c // st.block_size) for c in ctx)
        free = _UNBOUNDED if st.num_blocks is None else max(st.num_blocks - 1 - held, 0)
        views = [
            RequestView(
                live.req.key,
                c,
                proposer,
                _max_k(live, st, proposer),
                acceptance.mean(live.req.key, proposer),
                acceptance.std(live.req.key, proposer),
                live.last_k,
                live.last_accepted,
            )
            for live, c in zip(running, ctx, strict=True)
        ]
        steps = 1  # forwards a plan with every k = 0 runs (policies/replay_runs.py)
        if not rules.is_off:
            offers = [_offer(live, st, proposer) for live in running]
            left = [live.req.output_len - 1 - live.s for live in running]
            forward = _plain_forward_ms(costs, scorers, ctx) if len(running) == 1 else None
            steps = run_length(rules, offers, left, proposer, st.max_k, arrivals.has_waiting, forward)
        batch = BatchView(
            views, free, st.block_size, scorers, res.num_steps, decode_steps=steps, acceptance=acceptance
        )
        plan = policy.decide(batch, costs)
        if len(plan.k) != len(views) or plan.scorer not in scorers:
            raise ValueError(
                f"policy {label!r} returned {len(plan.k)} k for {len(views)} requests and scorer "
                f"{plan.scorer!r} (available: {', '.join(scorers)})"
            )
        ks = [min(k, v.max_k) for k, v in zip(plan.k, views, strict=True)]
        is_run = steps > 1 and not any(ks)
        if is_run:
            pred = costs.predict_run(plan.scorer, plain_stats(ctx), steps)
        else:
            pred = costs.predict(plan.scorer, proposer, StepShape(ks, ctx)).total_ms
        if churn is not None:
            ids = {live.req.key for live in running}
            pred, last_ids = churn.charged(pred, last_ids, ids), ids
        accepted = []
        for live, k in zip(running, ks, strict=True):
            a, world, imputed = 0, bits.bits[live.index], bits.imputed[live.index]
            for m in range(live.s + 1, live.s + 1 + k):
                res.num_bits_read += 1
                res.num_bits_imputed += imputed[m]
                if not world[m]:
                    break
                a += 1
            emitted = min(steps if is_run else a + 1, live.req.output_len - 1 - live.s)
            acceptance.observe(live.req.key, proposer, k, a)
            live.s, live.last_k, live.last_accepted = live.s + emitted, k, a
            res.num_tokens, res.num_decode_tokens = res.num_tokens + emitted, res.num_decode_tokens + emitted
            accepted.append(a)
        policy.observe(plan, accepted)
        res.num_steps += 1
        res.num_run_steps += steps if is_run else 0
        res.num_request_steps += len(ks)
        res.num_drafts += sum(ks)
        res.predicted_ms += pred
        arrivals.clock += pred
        res.scorer_steps[plan.scorer] = res.scorer_steps.get(plan.scorer, 0) + 1
        res.trace.append(StepTrace(len(ks), sum(ks) / len(ks), plan.scorer, pred))
        for live in [x for x in running if x.s >= x.req.output_len - 1]:
            running.remove(live)
            arrivals.finish(live.index)
            acceptance.forget(live.req.key)
    res.num_admitted = arrivals.num_admitted
    if arrivals.window_ms is not None:  # the prefills of the requests it sent, not the run's
        res.predicted_ms += each * res.num_admitted - prefill
    return res


@dataclass
class ReplayOptions:
    seed: int = 0  # of the imputation draws
    scorers: list[str] | None = None  # scorers the policies may pick; None = the run's
    forgetting: float = 1.0  # of the refitted cost model

    def __post_init__(self) -> None:
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"replay forgetting must be in (0, 1], got {self.forgetting}")
        if self.scorers is not None and not self.scorers:
            raise ValueError("replay scorers must name at least one scorer (or be null for the run's)")


@dataclass
class ReplayReport:
    run: RecordedRun
    bits: MatchBits
    costs: CostModels
    rows: list[PolicyResult]  # recorded, recorded policy replayed, then the alternatives
    fit_steps: dict[str, int]  # scorer -> recorded decode steps the cost model was fitted on


def default_policies() -> list[dict]:
    """Every built-in policy with its default settings."""
    return [{"name": name} for name in POLICIES]


def replay(
    run: RecordedRun, policies: Sequence[Mapping] | None = None, options: ReplayOptions | None = None
) -> ReplayReport:
    """The replay table's rows for ``policies`` (policy configs as for ``build_policy``; None: every
    built-in). A policy that cannot be built or run here gets a row with its ``error``."""
    opts = options or ReplayOptions()
    bits = complete_bits(run, opts.seed)
    costs = refit_costs(run, opts.forgetting)
    static = (
        refit_costs(run, opts.forgetting, without_decide_spill=True)
        if decide_spill_ms(run.decode_steps)
        else None
    )
    rows = [recorded_result(run, costs)]
    configs = ([run.settings.policy] if run.settings.policy else []) + [
        dict(p) for p in policies or default_policies()
    ]
    for cfg in configs:
        label = policy_label(cfg)
        try:
            policy = build_policy(cfg)
            rows.append(simulate(run, bits, policy, costs_for(policy, costs, static), label, opts.scorers))
        except ValueError as e:
            rows.append(PolicyResult(label, "replayed", error=str(e)))
    fit = Counter(s.scorer for s in run.decode_steps)
    return ReplayReport(run, bits, costs, rows, dict(fit))
