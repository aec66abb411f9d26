"""Static policies: ``fixed`` (one k, one scorer), ``threshold`` (scorer by batch size) and
``disable_by_batch`` (vLLM 0.6's ``speculative_disable_by_batch_size``); plus the helpers every
built-in uses to fill a plan's prediction."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

from specsched.policies.acceptance import expected_tokens
from specsched.policies.base import BatchView, Plan, Policy, RequestView
from specsched.policies.cost_model import CostModels
from specsched.policies.shapes import shape_stats


def step_proposer(view: BatchView) -> str:
    """The proposer label of the step, as the engine logs it: the batch's proposers joined by "+"."""
    return "+".join(sorted({r.proposer for r in view.requests})) or "none"


def check_scorer(policy: str, scorer: str, view: BatchView) -> str:
    if scorer not in view.scorers:
        available = ", ".join(view.scorers)
        raise ValueError(
            f"policy {policy!r}: scorer {scorer!r} is not available this run (available: {available})"
        )
    return scorer


def make_plan(
    policy: str,
    view: BatchView,
    costs: CostModels | None,
    k: list[int],
    scorer: str,
    info: dict | None = None,
) -> Plan:
    """A plan with its expected tokens (from each request's acceptance estimate) and, when cost
    models are given, its predicted step time; the per-component prediction goes to ``info`` as
    ``predicted_{propose,score,verify,overhead}_ms``."""
    info = dict(info or {})
    if len(k) != len(view.requests):
        raise ValueError(f"policy {policy!r}: {len(k)} k for {len(view.requests)} requests")
    plan = Plan(list(k), scorer, policy, expected_tokens=_expected_sum(view.requests, k), info=info)
    return predict_plan(plan, view, costs) if costs is not None else plan


def predict_plan(plan: Plan, view: BatchView, costs: CostModels) -> Plan:
    """``plan`` (decided for ``view``'s requests) with its predicted step time from ``costs``: the
    total in ``predicted_ms``, each component in ``info["predicted_{propose,score,verify,overhead}_ms"]``
    (in place; returned). A policy whose decide does not read the prediction
    (``Policy.is_prediction_deferred``) leaves it to the engine, which calls this while the GPU scores."""
    if view.requests:
        stats = shape_stats(list(plan.k), [r.context_len for r in view.requests])  # StepShape(...).stats()
        cost = costs.predict_stats(plan.scorer, step_proposer(view), stats)
        plan.predicted_ms = cost.total_ms
        plan.info.update({f"predicted_{name}": value for name, value in cost.as_dict().items()})
    return plan


def _expected_sum(views: list[RequestView], k: list[int]) -> float:
    """``sum(map(_expected_tokens, views, k))``, the usual case (acceptance in [0, 1), k >= 0) inline:
    the same formula, without two calls per request."""
    vals = []
    for r, ki in zip(views, k):
        a = r.acceptance
        if not (0.0 <= a < 1.0 and ki >= 0):
            vals.append(_expected_tokens(r, ki))
        elif ki == 0:
            vals.append(1.0)
        else:  # expected_tokens(a, ki)
            vals.append(float(ki + 1) if 1.0 - a < 1e-9 else (1.0 - a ** (ki + 1)) / (1.0 - a))
    return sum(vals)


def _expected_tokens(r: RequestView, k: int) -> float:
    """``expected_tokens`` at the request's acceptance clamped to [0, 1]; k = 0 (no speculation, the
    common case at large batches) is 1.0 without the call: the formula's (1 - a) / (1 - a)."""
    a = r.acceptance
    if k == 0 and 0.0 <= a < 1.0:
        return 1.0
    return expected_tokens(min(max(a, 0.0), 1.0), k)


def capped_k(view: BatchView, k: int) -> list[int]:
    """``k`` for every request, capped by each request's ``max_k``."""
    return [k if m >= k else max(0, m) for m in map(_max_k, view.requests)]


_max_k = attrgetter("max_k")


def _check_k(name: str, k: int) -> None:
    if k < 0:
        raise ValueError(f"policy {name}: k must be >= 0, got {k}")


def _check_batch(name: str, batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"policy {name}: batch_size must be >= 1, got {batch_size}")


@dataclass
class FixedConfig:
    k: int = 4
    scorer: str = "mqa"

    def __post_init__(self) -> None:
        _check_k("fixed", self.k)


class FixedPolicy(Policy):
    """Every request speculates ``min(k, its max_k)``; always the same scorer."""

    name = "fixed"
    config_cls = FixedConfig
    is_prediction_deferred = True  # costs only predict the step for the log

    def __init__(self, config: FixedConfig | None = None) -> None:
        self.config = config or FixedConfig()

    def decide(self, view: BatchView, costs: CostModels | None) -> Plan:
        scorer = check_scorer(self.name, self.config.scorer, view)
        return make_plan(self.name, view, costs, capped_k(view, self.config.k), scorer)


@dataclass
class ThresholdConfig:
    batch_size: int = 8  # batch < batch_size: small_scorer, else large_scorer
    k: int = 4
    small_scorer: str = "batch_expansion"
    large_scorer: str = "mqa"

    def __post_init__(self) -> None:
        _check_batch("threshold", self.batch_size)
        _check_k("threshold", self.k)


class ThresholdPolicy(Policy):
    """vLLM 0.6's rule of thumb, with a batch-size switch: small batches go to the graph-captured
    batch-expansion scorer (launch overhead dominates), large ones to MQA (KV reads dominate)."""

    name = "threshold"
    config_cls = ThresholdConfig
    is_prediction_deferred = True  # costs only predict the step for the log

    def __init__(self, config: ThresholdConfig | None = None) -> None:
        self.config = config or ThresholdConfig()

    def decide(self, view: BatchView, costs: CostModels | None) -> Plan:
        cfg = self.config
        scorer = cfg.small_scorer if view.batch_size < cfg.batch_size else cfg.large_scorer
        check_scorer(self.name, scorer, view)
        return make_plan(self.name, view, costs, capped_k(view, cfg.k), scorer)


@dataclass
class DisableByBatchConfig:
    batch_size: int = 16  # batch >= batch_size: k = 0 for everyone
    k: int = 4
    scorer: str = "mqa"

    def __post_init__(self) -> None:
        _check_batch("disable_by_batch", self.batch_size)
        _check_k("disable_by_batch", self.k)


class DisableByBatchPolicy(Policy):
    """vLLM 0.6 ``speculative_disable_by_batch_size``: speculation off once the batch reaches
    ``batch_size``, else a fixed k; always the same scorer."""

    name = "disable_by_batch"
    config_cls = DisableByBatchConfig
    is_prediction_deferred = True  # costs only predict the step for the log

    def __init__(self, config: DisableByBatchConfig | None = None) -> None:
        self.config = config or DisableByBatchConfig()

    def decide(self, view: BatchView, costs: CostModels | None) -> Plan:
        cfg = self.config
        scorer = check_scorer(self.name, cfg.scorer, view)
        is_off = view.batch_size >= cfg.batch_size
        k = [0] * view.batch_size if is_off else capped_k(view, cfg.k)
        return make_plan(self.name, view, costs, k, scorer, {"is_disabled": is_off})
