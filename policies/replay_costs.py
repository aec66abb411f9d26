"""The replay's costs: cost models refitted from a recorded run's measured steps, a record's predicted
ms, and the recorded policy's decide spill (the host time of deciding ahead that a policy which does
not would not pay). Used by :mod:`specsched.policies.replay` and the benchmarks that price policies on
one log (bench/replay_fidelity.py, bench/same_costs.py)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from specsched.engine.records import StepRecord
from specsched.policies.base import Policy
from specsched.policies.cost_model import CostModels
from specsched.policies.replay_churn import ChurnResidual
from specsched.policies.replay_log import RecordedRun, ReplayError
from specsched.policies.run_cost import plain_stats
from specsched.policies.shapes import StepShape

__all__ = ["costs_for", "decide_spill_ms", "record_ms", "record_shape", "refit_costs"]


def refit_costs(
    run: RecordedRun,
    forgetting: float = 1.0,
    count_between: bool = True,
    bucket_bias: bool = True,
    without_decide_spill: bool = False,
    churn: bool = True,
) -> CostModels:
    """Cost models fitted on the run's decode steps, from the device's seed coefficients
    (``forgetting`` 1.0: every step weighs the same, the run is taken as stationary; ``count_between``:
    a step costs its ``cost_ms``, the time before it included, else its ``total_ms``; ``bucket_bias``:
    with the graph scorers' per-graph residuals, policies/bucket_bias.py; ``without_decide_spill``:
    each step's total less its :func:`decide_spill_ms`, the host time of a policy that decides ahead
    which a policy that does not would not pay: the costs to replay such a policy with; ``churn``:
    with the residual of steps whose batch changed, ``costs.churn``, policies/replay_churn.py)."""
    device = "cuda" if run.device.startswith("cuda") else "cpu"
    costs = CostModels(
        run.settings.graph_buckets or None, device=device, forgetting=forgetting, count_between=count_between,
        bucket_bias=bucket_bias,
    )  # fmt: skip
    spill = decide_spill_ms(run.decode_steps) if without_decide_spill else {}
    for rec in run.decode_steps:
        if rec.step in spill:
            rec = replace(rec, total_ms=rec.total_ms - spill[rec.step])
        try:
            costs.observe(rec)
        except ValueError as e:
            raise ReplayError(f"{run.path}: damaged step rows in run {run.run_id} ({e})") from e
    if churn:
        costs.churn = ChurnResidual.fit(
            run.decode_steps,
            lambda rec: record_ms(costs, rec, run.settings.proposer),
            lambda rec: costs.step_ms(rec) - spill.get(rec.step, 0.0),
        )
    return costs


def record_ms(costs: CostModels, rec: StepRecord, proposer: str) -> float:
    """A decode record's predicted ms: one step at its shape, or a run of ``num_decode_steps`` plain
    steps (:meth:`CostModels.predict_run`)."""
    if rec.num_decode_steps > 1:
        ctx = [r.context_len + 1 for r in rec.requests]
        return costs.predict_run(rec.scorer, plain_stats(ctx), rec.num_decode_steps)
    return costs.predict(rec.scorer, rec.proposer or proposer, record_shape(rec)).total_ms


def record_shape(rec: StepRecord) -> StepShape:
    """A decode record's step shape (context as the policy sees it: KV-cached tokens + the input)."""
    return StepShape([r.k for r in rec.requests], [r.context_len + 1 for r in rec.requests])


def decide_spill_ms(steps: Sequence[StepRecord]) -> dict[int, float]:
    """Per decode step that decided the next plan ahead (the decode step right after it runs a fresh
    plan decided ahead: ``plan_info`` ``is_planned_ahead`` with ``plan_age`` 0), the part of that
    decide the GPU did not hide: its host ms after the scoring launch (``overlap`` + ``verify``, the
    read's wait included) beyond the median of the steps of its batch size that decided nothing ahead
    (engine/planning.py measures a decide's *exposed* ms the same way). Steps without host phases
    (logs before schema 3) and batch sizes without such a median get none."""
    deciding = {
        a.step
        for a, b in zip(steps, steps[1:])
        if b.step == a.step + 1 and b.plan_info.get("is_planned_ahead") and not b.plan_info.get("plan_age")
    }
    if not deciding:
        return {}
    post: dict[int, list[float]] = {}
    for s in steps:
        if s.step not in deciding and s.host_ms:
            post.setdefault(s.batch_size, []).append(
                s.host_ms.get("overlap", 0.0) + s.host_ms.get("verify", 0.0)
            )
    medians = {b: statistics.median(v) for b, v in post.items()}
    out = {}
    for s in steps:
        if s.step in deciding and s.host_ms and s.batch_size in medians:
            excess = s.host_ms.get("overlap", 0.0) + s.host_ms.get("verify", 0.0) - medians[s.batch_size]
            out[s.step] = min(max(excess, 0.0), s.total_ms)
    return out


def costs_for(policy: Policy, costs: CostModels, costs_without_spill: CostModels | None) -> CostModels:
    """The costs to replay ``policy`` with: a policy that never decides ahead (not
    ``is_plan_ahead_safe``) is charged the log's host time without the recorded policy's decide spill
    (:func:`decide_spill_ms`); one that does, with it."""
    if costs_without_spill is None or getattr(policy, "is_plan_ahead_safe", False):
        return costs
    return costs_without_spill
