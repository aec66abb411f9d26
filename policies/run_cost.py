"""What a run of plain decode steps costs (``scheduler.decode_steps``, engine/multi_step.py).

A run of S plain steps scores S forwards back to back and reads the host once: it pays S times a
plain step's scoring, and once its verification read, its overhead (the host's schedule, commit,
log) and the loop's time before it. So, from the single-step cost models at the k = 0 shape,

    T_run(S) = ratio_s · (S · score_ms + verify_ms + overhead_ms),

where ``ratio_s`` (per scorer) is the running mean of measured / predicted over the runs seen so
far (1 before any): the single-step models' own errors and what the model above leaves out (a run's
inputs for the next forward built on the device, one argmax per forward) are learned from the runs
themselves. The cost models skip a run's record for their own fit (it is not one step's cost), and
pass it here instead.

*Leaving a run costs more than its own ms.* A draft model with its own KV cache skips the plain
steps, so the first speculative step after them catches it up over every token it missed, as one
varlen forward with q > 2 per row: outside the draft's graphs, eager (on the 2026-12-06 H100 log, 7B
pair at batch 64: 7.4-10.9 ms against ~1 ms a step). The cost models leave that step out of the
propose fit (it is no steady-state cost) and keep its excess over the prediction per proposer
(:class:`CatchUpCost`). :func:`weigh_run` enters a run from speculation only once the runs passed
up since speculation last led would have saved that much (the predicted ms of drafting a run's
tokens less the run's, summed over consecutive decides where the run leads by ``margin``): the
rent-or-buy rule of the ski-rental problem (Karlin et al. 1988, "Competitive snoopy caching"), which
never pays more than twice what knowing the future would. A run ahead for good is taken after a few
decides; a lead that comes and goes with the models' errors (2-3 %) never adds up to a catch-up.
Without it such a lead flipped goodput between runs and speculation, each return paying the
catch-up: 0.94x the best fixed config at batch 64, a = 0.3, 2026-12-06 (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specsched.policies.shapes import ShapeStats

MIN_RATIO, MAX_RATIO = 0.25, 4.0  # a run's measured / predicted ms is clipped to this range


def plain_stats(context_lens: list[int]) -> ShapeStats:
    """The shape of one plain decode step (every k = 0) over requests with these context lengths (KV
    cached tokens plus the input token, as ``RequestView.context_len``)."""
    b, ctx = len(context_lens), sum(context_lens)
    return ShapeStats(b, b, 0, 0, 0, ctx, ctx)


def capped_run_steps(steps: int, cap_ms: float | None, forward_ms: float | None) -> int:
    """``steps`` plain forwards capped to about ``cap_ms`` (``scheduler.plain_decode_ms``; None: no cap)
    by a plain forward's ms (one step while that is unknown), at least 1: how long a run alone may be,
    for the engine (its measured forward) and the replay (a predicted one) alike."""
    if cap_ms is None:
        return steps
    if forward_ms is None or not forward_ms > 0:
        return 1
    return max(1, min(steps, int(cap_ms / forward_ms)))


@dataclass
class RunRatio:
    """Running mean of measured / predicted ms of a scorer's runs (the last ~``window`` weigh most)."""

    window: int = 16
    value: float = 1.0
    num_runs: int = 0

    def update(self, predicted: float, measured: float) -> None:
        if predicted <= 0 or measured <= 0:
            return
        ratio = min(max(measured / predicted, MIN_RATIO), MAX_RATIO)
        self.num_runs += 1
        self.value += (ratio - self.value) / min(self.num_runs, self.window)


@dataclass
class CatchUpCost:
    """Running mean of what a draft's catch-up after plain steps added to a speculative step's
    propose ms over the propose model's prediction (clipped at 0; the last ~``window`` weigh most)."""

    window: int = 16
    value: float = 0.0
    num_steps: int = 0

    def update(self, predicted: float, measured: float) -> None:
        if not (math.isfinite(predicted) and math.isfinite(measured)):
            return
        self.num_steps += 1
        self.value += (max(measured - predicted, 0.0) - self.value) / min(self.num_steps, self.window)


def run_ms(costs, scorer: str, stats: ShapeStats, num_steps: int, ratio: float = 1.0) -> float:
    """Predicted ms of a run of ``num_steps`` plain steps of shape ``stats`` on ``scorer`` (module
    docstring), from the single-step models of ``costs`` (a
    :class:`~specsched.policies.cost_model.CostModels`)."""
    c = costs.predict_stats(scorer, "none", stats)
    return ratio * (num_steps * c.score_ms + c.verify_ms + c.overhead_ms)


@dataclass
class RunChoice:
    """A run of plain decode steps weighed against a step's speculative plan."""

    goodput: float  # tokens / ms the run is predicted to give
    ms: float  # its predicted ms
    spec_goodput: float  # the speculative plan's (0: there was none to weigh it against)
    is_taken: bool  # the step runs it instead of the speculative plan
    # ms the runs passed up so far would have saved (the next decide's ``regret_ms``; 0 once taken)
    regret_ms: float = 0.0


def weigh_run(
    costs, scorer: str, context_lens: list[int], num_steps: int, g_spec: float | None, is_run: bool,
    margin: float, switch_ms: float = 0.0, regret_ms: float = 0.0,
) -> RunChoice:  # fmt: skip
    """Whether a step of requests with ``context_lens`` runs ``num_steps`` plain steps on ``scorer``
    (B · S tokens in :meth:`CostModels.predict_run` ms) instead of a speculative plan of goodput
    ``g_spec`` tokens/ms (None: there is none to replace: the plan drafts nothing, or it is a probe
    that is there to observe its drafts). With hysteresis: after a run (``is_run``) speculation must
    be ``margin`` better to take over; after a speculative step the run must be ``margin`` better
    and, with the passed-up runs' savings ``regret_ms`` (from the last decide's choice), have saved at
    least ``switch_ms``, what the return to drafting will cost (module docstring)."""
    ms = costs.predict_run(scorer, plain_stats(context_lens), num_steps)
    tokens = len(context_lens) * num_steps
    g_run = tokens / max(ms, 1e-9)
    if g_spec is None:
        return RunChoice(g_run, ms, 0.0, False, regret_ms)
    if is_run:
        return RunChoice(g_run, ms, g_spec, g_run * (1.0 + margin) >= g_spec)
    if g_run <= g_spec * (1.0 + margin):  # speculation holds: the passed-up savings start over
        return RunChoice(g_run, ms, g_spec, False)
    regret = regret_ms + tokens / max(g_spec, 1e-9) - ms  # drafting these tokens takes longer
    taken = regret >= switch_ms
    return RunChoice(g_run, ms, g_spec, taken, 0.0 if taken else regret)
