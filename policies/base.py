"""Policy interface: the per-step decision of k per request and the scorer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specsched.policies.acceptance import AcceptanceEstimator


@dataclass
class RequestView:
    """What a policy sees of one running request this step."""

    request_id: str
    context_len: int  # tokens in the KV cache + the step's input token
    proposer: str  # proposer name
    max_k: int  # the most this request may speculate now (n-gram match length, spec.max_k, ...)
    acceptance: float  # estimated per-token acceptance rate a in [0, 1)
    acceptance_std: float  # its uncertainty
    last_k: int = 0  # k chosen last step (for hysteresis / hf_heuristic)
    last_accepted: int = 0  # drafts accepted last step


@dataclass
class BatchView:
    """What a policy sees of the whole step."""

    requests: list[RequestView]
    num_free_blocks: int
    block_size: int
    scorers: list[str]  # scorers available this run
    step: int = 0
    # plain decode steps a plan with every k = 0 would run back to back (scheduler.decode_steps,
    # engine/multi_step.py): 1 when runs are off or this batch cannot run one (a sampled request, a
    # proposer with nothing on offer, a request about to finish)
    decode_steps: int = 1
    # the engine's acceptance estimator (policies/acceptance.py), for a policy that reads more of it
    # than each request's rate (goodput's staged_acceptance); None in views built without one
    acceptance: AcceptanceEstimator | None = None

    @property
    def batch_size(self) -> int:
        return len(self.requests)

    @property
    def num_context_tokens(self) -> int:
        return sum(r.context_len for r in self.requests)


@dataclass
class Plan:
    """A policy's decision for one step."""

    k: list[int]  # [B] proposals per request, 0 allowed
    scorer: str  # scorer name
    policy: str  # policy name that decided
    predicted_ms: float | None = None  # predicted step time (propose + score + verify + overhead)
    expected_tokens: float | None = None  # expected emitted tokens this step
    info: dict = field(default_factory=dict)  # policy's reasoning, for the log
    # an exploration plan (goodput's acceptance probe): its purpose is one step's outcomes, so the
    # engine runs it one step and decides again instead of carrying it (engine/planning.py)
    is_one_step: bool = False

    def __post_init__(self) -> None:
        if len(self.k) and min(self.k) < 0:  # one C-level pass (a plan is made and copied every step)
            bad = [k for k in self.k if k < 0]
            raise ValueError(f"plan k must be >= 0 for every request, got {bad[0]}")

    @property
    def max_k(self) -> int:
        return max(self.k, default=0)

    @property
    def num_tokens(self) -> int:
        """Tokens the scorer runs: sum over requests of k_i + 1."""
        return sum(k + 1 for k in self.k)


class Policy(ABC):
    """Decides a :class:`Plan` each step from a :class:`BatchView` and the cost models."""

    name: str = "base"
    # True when a plan decided one step early (before the previous step's verification and
    # ``observe``) is as good as one decided on time: the engine may then decide while the GPU
    # scores. False for policies that react to the last step's outcome (hf_heuristic, threshold).
    is_plan_ahead_safe: bool = False
    # True when decide reads the cost models only to predict the plan's step time for the log (the
    # static policies): the engine then decides with ``costs=None`` and fills the prediction
    # (:func:`specsched.policies.fixed.predict_plan`, the same costs) while the GPU scores, off the
    # step's critical path.
    is_prediction_deferred: bool = False

    @abstractmethod
    def decide(self, view: BatchView, costs) -> Plan:  # costs: specsched.policies.cost_model.CostModels
        ...

    def observe(self, plan: Plan, num_accepted: list[int]) -> None:  # noqa: B027
        """Feedback after verification (per-request accepted draft tokens)."""
