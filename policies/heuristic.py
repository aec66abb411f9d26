"""``hf_heuristic``: the assistant-token schedule of HF transformers' assisted generation."""

from __future__ import annotations

from dataclasses import dataclass

from specsched.policies.base import BatchView, Plan, Policy
from specsched.policies.cost_model import CostModels
from specsched.policies.fixed import check_scorer, make_plan


def hf_next_k(k: int, last_k: int, last_accepted: int) -> int:
    """The "heuristic" schedule of HF transformers' assisted generation
    (``num_assistant_tokens_schedule="heuristic"``): after a step that proposed ``last_k`` drafts,
    grow the number of assistant tokens ``k`` by 2 when all were accepted, else shrink it by 1
    (never below 1). A step without drafts (``last_k == 0``) leaves ``k`` unchanged."""
    if last_k <= 0:
        return k
    return k + 2 if last_accepted >= last_k else max(1, k - 1)


@dataclass
class HfHeuristicConfig:
    initial_k: int = 5  # a new request's number of assistant tokens
    max_k: int = 8  # cap on the schedule (each request's own max_k caps it further)
    scorer: str = "mqa"

    def __post_init__(self) -> None:
        if not 1 <= self.initial_k:
            raise ValueError(f"policy hf_heuristic: initial_k must be >= 1, got {self.initial_k}")
        if self.max_k < 1:
            raise ValueError(f"policy hf_heuristic: max_k must be >= 1, got {self.max_k}")


class HfHeuristicPolicy(Policy):
    """Per request: k += 2 when all of last step's drafts were accepted, else max(1, k − 1);
    capped by ``max_k`` and the request's own max_k (an n-gram request without a match gets 0,
    and keeps its schedule for the next match). One scorer for all."""

    name = "hf_heuristic"
    config_cls = HfHeuristicConfig
    is_prediction_deferred = True  # costs only predict the step for the log

    def __init__(self, config: HfHeuristicConfig | None = None) -> None:
        self.config = config or HfHeuristicConfig()
        self._schedule: dict[str, int] = {}  # request_id -> its number of assistant tokens

    def decide(self, view: BatchView, costs: CostModels | None) -> Plan:
        cfg = self.config
        scorer = check_scorer(self.name, cfg.scorer, view)
        schedule, k = {}, []
        for r in view.requests:
            current = self._schedule.get(r.request_id, min(cfg.initial_k, cfg.max_k))
            current = min(hf_next_k(current, r.last_k, r.last_accepted), cfg.max_k)
            schedule[r.request_id] = current
            k.append(max(0, min(current, r.max_k)))
        self._schedule = schedule  # requests that left the batch are dropped
        return make_plan(self.name, view, costs, k, scorer)
