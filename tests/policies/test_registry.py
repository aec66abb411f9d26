from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specsched.policies.base import BatchView, Plan, Policy, RequestView
from specsched.policies.cost_model import CostModels
from specsched.policies.fixed import FixedPolicy
from specsched.policies.goodput import GoodputPolicy
from specsched.policies.registry import POLICIES, build_policy

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@dataclass
class EveryOtherConfig:
    k: int = 3


class EveryOtherPolicy(Policy):
    """A user policy defined here: odd-numbered requests speculate."""

    name = "every_other"
    config_cls = EveryOtherConfig

    def __init__(self, config: EveryOtherConfig | None = None) -> None:
        self.config = config or EveryOtherConfig()

    def decide(self, view: BatchView, costs) -> Plan:
        return Plan(
            [self.config.k if i % 2 else 0 for i in range(view.batch_size)], view.scorers[0], self.name
        )


class KwargsPolicy(Policy):
    name = "kwargs"

    def __init__(self, k: int = 1) -> None:
        self.k = k

    def decide(self, view: BatchView, costs) -> Plan:
        return Plan([self.k] * view.batch_size, view.scorers[0], self.name)


class NotAPolicy:
    pass


def view(n: int = 4, a: float = 0.7) -> BatchView:
    return BatchView([RequestView(f"r{i}", 50, "draft", 8, a, 0.1) for i in range(n)], 100, 16, ["mqa"])


def test_builtins_by_name_with_options():
    assert set(POLICIES) == {"fixed", "threshold", "disable_by_batch", "hf_heuristic", "goodput"}
    policy = build_policy({"name": "fixed", "k": 2, "scorer": "mqa"})
    assert isinstance(policy, FixedPolicy) and policy.config.k == 2
    goodput = build_policy(OmegaConf.create({"name": "goodput", "scorers": ["mqa"], "scorer_margin": 0.1}))
    assert isinstance(goodput, GoodputPolicy) and goodput.config.scorers == ["mqa"]


def test_registry_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown policy 'nope'; known: fixed, threshold"):
        build_policy({"name": "nope"})
    with pytest.raises(ValueError, match="unknown option 'kk' for policy 'fixed'; known: k, scorer"):
        build_policy({"name": "fixed", "kk": 3})
    with pytest.raises(ValueError, match="needs 'name'"):
        build_policy({"k": 3})
    with pytest.raises(ValueError, match="must be a mapping"):
        build_policy("goodput")
    with pytest.raises(ValueError, match="k must be >= 0"):
        build_policy({"name": "fixed", "k": -2})


def test_target_loads_a_user_policy_from_this_module():
    policy = build_policy({"_target_": f"{__name__}.EveryOtherPolicy", "k": 5})
    assert isinstance(policy, EveryOtherPolicy)
    assert policy.decide(view(4), CostModels()).k == [0, 5, 0, 5]
    named = build_policy({"_target_": f"{__name__}.EveryOtherPolicy", "name": "mine"})
    assert named.name == "mine" and named.config.k == 3
    assert build_policy({"_target_": f"{__name__}.KwargsPolicy", "k": 2}).k == 2
    with pytest.raises(ValueError, match="bad options"):
        build_policy({"_target_": f"{__name__}.KwargsPolicy", "kk": 2})
    with pytest.raises(ValueError, match="unknown option 'x'"):
        build_policy({"_target_": f"{__name__}.EveryOtherPolicy", "x": 1})


@pytest.mark.parametrize(
    "target,match",
    [
        ("NoDots", "package.module.ClassName"),
        ("no_such_module_xyz.Policy", "cannot import module"),
        ("specsched.policies.fixed.NoSuchClass", "has no 'NoSuchClass'"),
        (f"{__name__}.NotAPolicy", "not a subclass"),
    ],
)
def test_target_errors(target, match):
    with pytest.raises(ValueError, match=match):
        build_policy({"_target_": target})


def test_docs_example_policy_runs(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    policy = build_policy({"_target_": "my_policy.ConfidentPolicy", "min_acceptance": 0.6, "k": 3})
    v = view(3)
    v.requests[1].acceptance = 0.4
    plan = policy.decide(v, CostModels())
    assert plan.k == [3, 0, 3] and plan.policy == "confident"
    assert plan.predicted_ms > 0 and plan.expected_tokens > 3
    with pytest.raises(ValueError, match="min_acceptance"):
        build_policy({"_target_": "my_policy.ConfidentPolicy", "min_acceptance": 2.0})


def test_docs_show_the_example_as_it_is():
    doc = (EXAMPLES.parent / "policies.md").read_text()
    code = (EXAMPLES / "my_policy.py").read_text().split("from __future__ import annotations\n", 1)[1]
    for line in code.strip().splitlines():
        assert line in doc, f"docs/policies.md lacks the example line {line!r}"
