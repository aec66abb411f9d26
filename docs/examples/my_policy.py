"""An example user policy: speculate only on requests whose acceptance estimate is high enough."""

from __future__ import annotations

from dataclasses import dataclass

from specsched.policies.base import BatchView, Plan, Policy
from specsched.policies.fixed import make_plan


@dataclass
class ConfidentConfig:
    min_acceptance: float = 0.5  # below this estimate a request does not speculate
    k: int = 4
    scorer: str = "mqa"

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")


class ConfidentPolicy(Policy):
    name = "confident"
    config_cls = ConfidentConfig  # build_policy passes the options here

    def __init__(self, config: ConfidentConfig | None = None) -> None:
        self.config = config or ConfidentConfig()

    def decide(self, view: BatchView, costs) -> Plan:
        cfg = self.config
        k = [min(cfg.k, r.max_k) if r.acceptance >= cfg.min_acceptance else 0 for r in view.requests]
        return make_plan(self.name, view, costs, k, cfg.scorer)  # fills predicted ms and expected tokens
