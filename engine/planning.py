"""Which plan a decode step runs: one decided ahead, an earlier plan carried over, or a new decide.

The policy's ``decide`` is host work (at batch 64 the goodput search and the second view it needs
take ~1-2 ms of Python on the H200 host), and its plans move slowly: the acceptance posteriors and
cost models it reads change little from one step to the next. So the engine treats the decide's
cost as part of the step's cost and decides only as often as that cost allows:

- **Planned ahead** (``scheduler.plan_ahead``, at batches up to ``scheduler.plan_ahead_max_batch``; a
  larger batch whose offers were cut decides on the step, on its own offers: docs/policies.md): on
  CUDA the next step's plan is decided while the GPU scores this step, from a view that offers every
  request the full ``spec.max_k`` (this step's tokens are not committed yet, so a proposer's peek
  would be a step old: on the H200 on 2026-12-04 a third of goodput's draftable steps at N = 1 ran k =
  0 because the n-gram match came with the step before); carrying the plan caps each k by the step's
  own peek. That hides the decide only while it is shorter than the scoring forward;
  :class:`PlanReuse` measures the part it does not hide (*exposed* ms, at most the planning ms): the
  host time from the end of the scoring launch to the end of the verification read (``overlap`` +
  ``verify``) beyond that of the steps that decided nothing ahead (an EMA of theirs; when every step
  decides ahead, one in ``BASELINE_EVERY`` skips it and runs the held plan one step more, to keep that
  baseline). With ``scheduler.carry_late_due`` a held plan that became due only since the last
  step's check (the interval below shrank as its EMAs moved) runs one step more, and that step's
  scoring decides the next one ahead (off: such a step decides on its critical path).
  The scoring forward's own event time is no baseline: on a GPU that waits for the host to
  pack and launch it, it spans the packing too (H200, 2026-12-04, N = 64: deciding steps ran 0.4-1 ms
  longer than the others while that measure called them hidden, so a decide ran every 1-3 steps
  against a 5 % budget: goodput 0.90x hf_heuristic). The next step pays for it too: the decide
  fills the device wait in which the daemon's IO and log threads do their work, which then runs at
  that step's releases of the interpreter lock (the loop between the steps, its first event record,
  the scoring's CUDA calls). So the exposed ms also counts that step's ``SPILL_PHASES`` beyond
  their EMA over steps that did not follow a decide ahead (H100 serve log, 2026-12-06 17:29, goodput
  at N = 4 / 16: the deciding step +0.08 / +0.09 ms, the next +0.12 / +0.14, of which the old
  measure saw the first).
- **Carried over** (``scheduler.decide_budget``): a plan is used again for up to
  ``interval - 1`` more steps, ``interval = ceil(exposed / (budget · step ms))``, so that deciding
  costs about ``budget`` of the step time on average (1 = decide every step, which is what a cheap
  decide at batch 1 gets). On the CPU path a decide is on the critical path: all of it is exposed.
  With ``scheduler.decide_cost=host`` a decide ahead counts all of its host ms, not the exposed part:
  on a host-bound loop the interpreter lock is the bottleneck, and the host time a decide takes while
  the GPU scores pushes the daemon's other work (streaming, the log writer, the next launch) later.
  On the H200 on 2026-12-05 at N = 64 goodput's steps without a decide ran 0.56 ms longer than fixed
  k = 8's, beside the 0.66 ms the deciding steps waited for.

A plan is *carried* to a step's batch by request id (:func:`carry_plan`): requests that left are
dropped, every k is capped by the request's cap now (n-gram matches and remaining lengths move on),
and requests that joined since (fresh from prefill) take the k of the kept request with the nearest
acceptance estimate. When more than ``max_joined`` of the batch (``scheduler.max_joined_share``,
default ``MAX_JOINED``) is new, the next decide is due: with
plan-ahead it is decided during this step's scoring (a decide on the critical path costs ~1 ms at
batch 16 on the H200 host, and on 2026-12-04 those decides, fed into the budget, kept plans carried
for up to 8 steps with the newcomers at k = 0: goodput 12% behind fixed k = 5 at N = 16); without
plan-ahead it is decided at once. Only policies that declare
``is_plan_ahead_safe`` (their plan does not react to the last step's outcome) get either.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from specsched.engine.carry import carry_plan, intent_k
from specsched.engine.config import SchedulerConfig
from specsched.policies.base import BatchView, Plan, Policy

# a plan is carried to a batch of which at most this share (or 1 request) is new: the scheduler's default
MAX_JOINED = SchedulerConfig.max_joined_share
# a batch above ``ahead_max_batch`` still plans ahead while at most this share of its requests had an
# offer below spec.max_k at the last step: then the ahead view (every offer max_k) is about the batch
# the step will see (a draft model's offers), and the decide stays hidden behind a GPU-bound forward
OFFER_CUT_SHARE = 0.25
BASELINE_EVERY = 32  # steps: a decide ahead is skipped (the held plan runs one step more) when the
# post-launch time of a step without one is older than this (with interval 1 there is no other)
# the phases of the step after a decide ahead in which the daemon's other threads run the work that
# decide kept from them (the device wait it filled): the loop before the step, its first event
# record, the scoring's input build and launch
SPILL_PHASES = ("between", "first_event", "score")


class PlanReuse:
    """How often the engine decides. The engine calls :meth:`on_new_plan` when a step gets a fresh
    plan, :meth:`on_use` each time a step runs the plan held, :meth:`record_decide` with each
    decide's exposed ms and :meth:`observe_step` with each decode step's wall ms; ``is_due`` says
    whether the held plan has been used ``interval`` times. ``budget`` None: decide every step."""

    def __init__(
        self, budget: float | None, max_age: int, smoothing: float = 0.2, is_backoff: bool = False
    ) -> None:
        self.budget, self.max_age, self.smoothing = budget, max_age, smoothing
        self.exposed_ms: float | None = None  # EMA over decides: the ms of each that a step waited for
        self.step_ms: float | None = None  # EMA over decode steps: wall ms, the loop between included
        self.age = 0  # steps that have run the held plan
        # scheduler.decide_backoff: the interval doubles with each decide in a row that gave the plan
        # it replaced (:meth:`on_decided`), up to max_age; a changed plan resets it
        self.is_backoff = is_backoff
        self.num_unchanged = 0  # decides in a row whose plan equalled the one it replaced

    @property
    def interval(self) -> int:
        """Steps per decide: 1 while a decide costs at most ``budget`` of a step, at most ``max_age``;
        with backoff, that times 2 per decide in a row that changed nothing."""
        if self.budget is None or not self.step_ms or not self.exposed_ms:
            return 1
        base = math.ceil(self.exposed_ms / (self.budget * self.step_ms))
        if self.is_backoff:
            base <<= min(self.num_unchanged, 16)
        return max(1, min(self.max_age, base))

    def on_decided(self, is_changed: bool) -> None:
        """A decide's plan did (not) differ from the plan it replaced (:func:`is_same_plan`)."""
        self.num_unchanged = 0 if is_changed else self.num_unchanged + 1

    @property
    def is_due(self) -> bool:
        """The held plan has run ``interval`` steps: the next step gets a fresh one."""
        return self.age >= self.interval

    def on_new_plan(self) -> None:
        self.age = 0

    def on_use(self) -> None:
        self.age += 1

    def expire(self) -> None:
        """The held plan is due after this step, whatever the interval."""
        self.age = max(self.age, self.max_age)

    def record_decide(self, exposed_ms: float) -> None:
        self.exposed_ms = self.ema(self.exposed_ms, max(exposed_ms, 0.0))

    def observe_step(self, step_ms: float) -> None:
        self.step_ms = self.ema(self.step_ms, step_ms)

    def ema(self, mean: float | None, x: float) -> float:
        """``mean`` moved toward ``x`` by ``smoothing`` (``x`` itself when there is no mean yet)."""
        return x if mean is None else (1.0 - self.smoothing) * mean + self.smoothing * x


def is_same_plan(old: tuple[list[str], Plan, bool] | None, ids: list[str], plan: Plan) -> bool:
    """Whether ``plan`` (decided for requests ``ids``) repeats the held plan ``old`` (its ids, plan,
    is-ahead flag): the same scorer and, on every request both were decided for (at least one), the
    same k — each plan's ``info["k_intent"]`` where it has one (the k had the request been offered every
    draft), so an offer that moved is no change. An exploration probe is never the same."""
    if old is None or plan.is_one_step or old[1].is_one_step or plan.scorer != old[1].scorer:
        return False
    old_k = dict(zip(old[0], intent_k(old[1]), strict=True))
    common = [(old_k[rid], k) for rid, k in zip(ids, intent_k(plan), strict=True) if rid in old_k]
    return bool(common) and all(a == b for a, b in common)


def timed_decide(policy: Policy, costs, view: BatchView) -> Plan:
    """The policy's decide, its wall ms in ``plan.info["decide_ms"]`` and the engine thread's CPU ms
    during it in ``plan.info["decide_cpu_ms"]`` (the log's plan_info): wall beyond CPU is time the
    thread waited, for the interpreter lock while the daemon's other threads ran or for a core (H100,
    2026-12-07 22:27: decides of 0.23 / 2.47 ms wall at N = 1 / 64 where the same decides replayed on
    the dev CPU took 0.06 / 0.62 ms of CPU, and the host's pure-Python phases ran ~2.2x the dev CPU's)."""
    c0 = time.thread_time()  # outside the wall clock's bracket: decide_ms times the decide alone
    t0 = time.perf_counter()
    plan = policy.decide(view, costs)
    t1 = time.perf_counter()
    c1 = time.thread_time()
    return replace(plan, info={**plan.info, "decide_ms": (t1 - t0) * 1e3, "decide_cpu_ms": (c1 - c0) * 1e3})


class Planner:
    """The engine's decide (module docstring): :meth:`plan` on the step's critical path,
    :meth:`decide_ahead` while the GPU scores, :meth:`observe` with each decode step's times. The
    policy and cost models are passed in on every call (the engine's may be swapped between steps)."""

    def __init__(
        self,
        budget: float | None,
        max_age: int,
        is_plan_ahead: bool,
        max_joined: float = MAX_JOINED,
        is_host_cost: bool = False,
        ahead_max_batch: int | None = None,
        is_spill_counted: bool = True,
        is_backoff: bool = False,
        is_late_carry: bool = False,
    ) -> None:
        self.reuse = PlanReuse(budget, max_age, is_backoff=is_backoff)
        self.is_late_carry = is_late_carry  # scheduler.carry_late_due: see _is_late_due
        self.ahead_max_batch = ahead_max_batch  # plan ahead only at batches this small (None: any)
        self.is_host_cost = is_host_cost  # a decide ahead costs all its host ms (scheduler.decide_cost)
        self.is_spill_counted = is_spill_counted  # and the next step's SPILL_PHASES (decide_cost=exposed)
        self.is_plan_ahead = is_plan_ahead
        self.max_joined = max_joined  # a held plan is due once more than this share of the batch joined
        # the plan steps run now: (request ids it was decided for, plan, is it the one decided ahead
        # and not used yet)
        self.held: tuple[list[str], Plan, bool] | None = None
        self.held_caps: dict[str, int] | None = None  # the held plan's requests' max_k when decided
        self._ahead_ms: float | None = None  # the host ms of this step's decide ahead (view + decide)
        self._post_ms: float | None = None  # EMA: overlap + verify ms of steps that did not decide ahead
        self._spill_base_ms: float | None = None  # EMA: SPILL_PHASES ms of steps not after a decide ahead
        # (exposed ms, cap) of the last decide ahead, recorded once the step after it adds its spill
        self._pending: tuple[float, float] | None = None
        self._since_post = BASELINE_EVERY  # steps since the last one that did not decide ahead
        self._is_grace = False  # the held plan runs the next step even if due (a skipped decide ahead)

    def plan(self, policy: Policy, costs, view: BatchView) -> Plan:
        """This step's plan: the held one carried to the batch, or a decide now."""
        plan = self.carried(policy, view)
        if plan is None:
            plan = timed_decide(policy, costs, view)
            self.reuse.record_decide(plan.info["decide_ms"])  # on the critical path: all of it
            self.reuse.on_new_plan()
            if policy.is_plan_ahead_safe:  # else never carried: no per-request copy of the plan's ids
                ids = [v.request_id for v in view.requests]
                self._note_change(ids, plan)
                self.held = ids, plan, False
                self.held_caps = {v.request_id: v.max_k for v in view.requests}
            else:
                self.held, self.held_caps = None, None
        self.reuse.on_use()
        if self.held is not None and self.held[1].is_one_step:
            self.reuse.expire()  # its step's outcomes are what it was for: the next step decides again
        return plan

    def carried(self, policy: Policy, view: BatchView) -> Plan | None:
        """The held plan carried to ``view``'s batch: the plan decided ahead during the last step's
        scoring, or an earlier plan while the decide budget says it is not due; None: decide now.
        The policy saw every outcome but those since the plan was decided."""
        if self.held is None or not policy.is_plan_ahead_safe:
            return None
        ids, plan, is_ahead = self.held
        is_kept = self.reuse.budget is not None and not self.reuse.is_due
        if not (is_ahead or self._is_grace or is_kept or self._is_late_due(plan, len(view.requests))):
            return None
        self._is_grace = False
        # with plan-ahead a batch that changed much still runs the held plan (joined requests
        # drafting like their nearest kept ones) and the next plan is decided ahead during this
        # step's scoring, instead of a decide on this step's critical path
        carried = carry_plan(ids, plan, view, None if self.is_plan_ahead else self.max_joined, self.held_caps)
        if carried is None:
            return None
        num_may_join = max(1, int(self.max_joined * len(view.requests)))
        if self.is_plan_ahead and carried.info["num_joined"] > num_may_join:
            self.reuse.expire()
        self.held = ids, plan, False
        info = carried.info
        info["plan_age"] = self.reuse.age  # steps that ran it before this one
        if is_ahead:
            info["is_planned_ahead"] = True
        else:
            info["decide_ms"] = info["decide_cpu_ms"] = 0.0  # this step did not decide (plan_age > 0)
        return carried

    def _is_late_due(self, plan: Plan, batch_size: int) -> bool:
        """The held plan, not decided ahead, became due between the last step's decide-ahead check and
        this step (the interval shrank as the budget's EMAs moved: at N = 1 on the H100 on 2026-12-07,
        8 % of goodput's steps decided on the critical path that way, 0.11 ms each): with
        ``scheduler.carry_late_due`` it runs one step more and this step's scoring decides the next
        plan ahead (it is due), unless the batch is one that decides on the step (above
        ``ahead_max_batch``), the plan was for one step, or it is ``max_age`` old."""
        return (
            self.is_late_carry
            and self.is_plan_ahead
            and self.reuse.budget is not None
            and not plan.is_one_step
            and self.reuse.age < self.reuse.max_age
            and (self.ahead_max_batch is None or batch_size <= self.ahead_max_batch)
        )

    def decide_ahead(
        self,
        policy: Policy,
        costs,
        make_view: Callable[[], BatchView],
        batch_size: int | None = None,
        count_cut: Callable[[], int] | None = None,
    ) -> None:
        """While the GPU scores: the next step's plan, for this step's requests (``make_view``, of
        ``batch_size`` requests; ``count_cut()``: how many had an offer below ``spec.max_k`` this
        step, counted only when asked), when plan-ahead is on, the policy allows it and the held plan
        is due — and, for a batch above ``ahead_max_batch``, only while at most ``OFFER_CUT_SHARE`` of
        it had its offer cut (else the due decide runs on the next step, on its offers)."""
        if not (self.is_plan_ahead and policy.is_plan_ahead_safe and self.reuse.is_due):
            return
        if self.ahead_max_batch is not None and batch_size is not None and batch_size > self.ahead_max_batch:
            if count_cut is None or count_cut() > OFFER_CUT_SHARE * batch_size:
                return
        is_carried = self.held is not None and not self.held[1].is_one_step  # a probe does not run twice
        if self.reuse.budget is not None and self._since_post >= BASELINE_EVERY and is_carried:
            self._is_grace = True  # this step measures the baseline; the held plan runs one step more
            return
        t0 = time.perf_counter()
        view = make_view()
        ahead = timed_decide(policy, costs, view)
        self._ahead_ms = (time.perf_counter() - t0) * 1e3
        self.reuse.on_new_plan()
        ids = [v.request_id for v in view.requests]
        self._note_change(ids, ahead)
        self.held = ids, ahead, True
        self.held_caps = {v.request_id: v.max_k for v in view.requests}

    def _note_change(self, ids: list[str], plan: Plan) -> None:
        """Before ``plan`` replaces the held one: tell the backoff whether it changed anything (only
        with ``scheduler.decide_backoff``: the comparison is host work on every decide)."""
        if self.reuse.is_backoff:
            self.reuse.on_decided(not is_same_plan(self.held, ids, plan))

    def observe(self, score_ms: float, host_ms: dict[str, float]) -> None:
        """A decode step's wall ms (its host phases, the loop's ``between`` included) and, when it
        decided ahead, the ms of that decide it waited for: its host time after the scoring launch
        (``overlap`` + ``verify``) beyond the EMA of the steps that did not decide ahead, plus what
        the next step's ``SPILL_PHASES`` take beyond theirs (recorded at that step: module
        docstring). Until a step without a decide ahead is seen: the launch and that time beyond the
        forward's event time (``score_ms``), the old measure (on the CPU path, where nothing
        overlaps, that sum is the decide)."""
        self.reuse.observe_step(sum(host_ms.values()))
        spill = sum(host_ms.get(p, 0.0) for p in SPILL_PHASES)
        if self._pending is not None:  # this step ran the plan decided during the last one's scoring
            exposed, cap = self._pending
            self._pending = None
            if self._spill_base_ms is not None and self.is_spill_counted:
                exposed += spill - self._spill_base_ms
            self.reuse.record_decide(min(max(exposed, 0.0), cap))
        else:
            self._spill_base_ms = self.reuse.ema(self._spill_base_ms, spill)
        if self.is_host_cost and self._ahead_ms is not None:
            self.reuse.record_decide(self._ahead_ms)
            self._ahead_ms = None
            return
        post = host_ms.get("overlap", 0.0) + host_ms.get("verify", 0.0)
        if self._ahead_ms is None:
            self._post_ms, self._since_post = self.reuse.ema(self._post_ms, post), 0
            return
        self._since_post += 1
        if self._post_ms is not None:
            excess = post - self._post_ms
        else:
            excess = host_ms.get("score", 0.0) + host_ms.get("overlap", 0.0) - score_ms
        self._pending = excess, self._ahead_ms
        self._ahead_ms = None
