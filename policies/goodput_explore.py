"""What the ``goodput`` policy does besides maximising predicted goodput: the scorer of a plain decode
step, and when to explore.

Terms: a *plain decode step* is a step where every request has k = 0 (one token scored each); a
scorer's cost model is *mature* once it has seen ``min_steps`` steps, *young* before.
"""

from __future__ import annotations

from collections.abc import Sequence

from specsched.policies.cost_model import CostModels
from specsched.policies.shapes import StepShape

__all__ = ["decode_scorer"]


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

    A scorer whose model has seen fewer than ``min_steps`` plain decodes (``costs.num_decodes``) and is priced
    within ``tolerance`` of the best is tried instead, the least tried first: its model has not seen
    this shape, and a try costs at most ``tolerance`` of one step. A young model is priced by its
    device seed against the best one's seed: an unobserved model predicts its seed, whose level can
    be far off for a model of another size (the cuda seeds are a 7B model's) while the seeds' ratio
    between scorers still holds. Without the tries a decode graph never used while speculating is
    never seen to be the cheaper one (issue 13: k = 0 steps on the MQA graph at 1.20 ms, the decode
    graph's were 1.14 ms).
    """
    index = range(len(scorers))
    num_decodes = [costs.num_decodes.get(s, 0) for s in scorers]
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
