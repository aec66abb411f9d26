"""What the ``goodput`` policy does besides maximising predicted goodput: the scorer of a plain decode
step, and when to explore.

Terms: a *plain decode step* is a step where every request has k = 0 (one token scored each); a
scorer's cost model is *mature* once it has seen ``min_steps`` steps, *young* before.
"""

from __future__ import annotations

from collections.abc import Sequence

from specsched.policies.cost_model import CostModels
from specsched.policies.shapes import StepShape

__all__ = ["ExplorationSwitch", "decode_scorer"]


def decode_scorer(
    costs: CostModels,
    scorers: Sequence[str],
    goodput_k0: Sequence[float],
    context_lens: Sequence[int],
    min_steps: int,
    tolerance: float,
) -> tuple[int, bool]:
    """(index into ``scorers`` of the scorer for a plain decode step, whether it is a *try*).

    Every scorer emits the same tokens at k = 0, so the step goes to the one predicted cheapest
    (``goodput_k0[s]``: tokens per predicted ms at k = 0) among the mature models, with no
    hysteresis: the speculative steps' scorer choice is not this step's. Ties go to an expansion
    scorer (its k = 0 step *is* the plain decode, on CUDA the decode graph).

    A scorer whose model has seen fewer than ``min_steps`` plain decodes (``costs.num_decodes``, and
    the steps of runs on it, ``costs.num_run_steps``) and is priced within ``tolerance`` of the best
    is tried instead, the least tried first: its model has not seen this shape, and a try costs at
    most ``tolerance`` of one step. A run's steps count: with runs on (``scheduler.decode_steps``)
    every plain step is in one, and runs teach their own ratio, not the step models, so without
    them a try never ended (H100, 2026-12-06, batch 64, a = 0.3: 16 of goodput's 103 runs on the
    MQA graph, 6 % dearer than the decode graph's). A young model is priced by its
    device seed against the best one's seed: an unobserved model predicts its seed, whose level can
    be far off for a model of another size (the cuda seeds are a 7B model's) while the seeds' ratio
    between scorers still holds. Without the tries a decode graph never used while speculating is
    never seen to be the cheaper one (issue 13: k = 0 steps on the MQA graph at 1.20 ms, the decode
    graph's were 1.14 ms).
    """
    index = range(len(scorers))
    num_decodes = [costs.num_decodes.get(s, 0) + costs.num_run_steps.get(s, 0) for s in scorers]
    is_exp = [s in costs.expansion_scorers for s in scorers]
    is_mature = [costs.model("score", scorers[s]).num_updates >= min_steps for s in index]
    best = max((s for s in index if is_mature[s]), default=None, key=lambda s: (goodput_k0[s], is_exp[s]))
    if best is None:
        return max(index, key=lambda s: (goodput_k0[s], is_exp[s])), False
    seed: dict[int, float] = {}

    def is_close(s: int) -> bool:
        if is_mature[s]:
            return goodput_k0[s] >= goodput_k0[best] * (1.0 - tolerance)
        if not seed:
            stats = StepShape([0] * len(context_lens), list(context_lens)).stats()
            seed.update({t: costs.prior_score_ms(scorers[t], stats) for t in index})
        return seed[s] <= seed[best] * (1.0 + tolerance)

    tries = [s for s in index if s != best and num_decodes[s] < min_steps and is_close(s)]
    if not tries:
        return best, False
    return min(tries, key=lambda s: (num_decodes[s], not is_exp[s])), True


class ExplorationSwitch:
    """Whether ``goodput`` explores (probes and dither) this step.

    Exploration pays now (a step planned off the predicted best) for estimates that decide later
    steps; once they are good, it only costs. On at the start; off once, after at least ``min_steps``
    decides on, both hold: the *posterior spread* — the mean sd of the acceptance posteriors of the
    requests that could draft — is at most ``stop_std``, and the *error*, the size of the chosen
    scorer's running bias of predicted vs measured step ms (:meth:`CostModels.prediction_error`,
    signed: the step-to-step noise averages out of it, a model that no longer fits does not), is at
    most ``stop_error``. On again when either exceeds ``restart`` times its threshold (a step change in
    costs, a young request with a wide posterior), which the gap between the thresholds keeps from
    flapping. ``stop_std`` or ``stop_error`` 0: never off (always explore).
    """

    def __init__(self, stop_std: float, stop_error: float, restart: float, min_steps: int) -> None:
        self.stop_std, self.stop_error, self.restart, self.min_steps = (
            stop_std,
            stop_error,
            restart,
            min_steps,
        )
        self.is_on, self.steps_on = True, 0
        self.num_stops = self.num_restarts = 0

    def update(self, spread: float | None, error: float | None) -> bool:
        """Advance one decide; ``spread`` None: no request could draft, ``error`` None: not known
        yet. Returns True when exploration restarts at this decide."""
        spread = 0.0 if spread is None else spread
        if self.is_on:
            self.steps_on += 1
            if (
                self.steps_on >= self.min_steps
                and self.stop_std > 0
                and self.stop_error > 0
                and error is not None
                and spread <= self.stop_std
                and error <= self.stop_error
            ):
                self.is_on, self.num_stops = False, self.num_stops + 1
            return False
        if spread > self.restart * self.stop_std or (
            error is not None and error > self.restart * self.stop_error
        ):
            self.is_on, self.steps_on, self.num_restarts = True, 1, self.num_restarts + 1
            return True
        return False
