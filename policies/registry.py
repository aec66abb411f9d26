"""Policy registry: built-ins by their hydra option name (``policy=goodput``), any importable
:class:`Policy` subclass by ``_target_``."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping

from specsched.policies.base import Policy
from specsched.policies.fixed import DisableByBatchPolicy, FixedPolicy, ThresholdPolicy
from specsched.policies.goodput import GoodputPolicy
from specsched.policies.heuristic import HfHeuristicPolicy

POLICIES: dict[str, type[Policy]] = {
    "fixed": FixedPolicy,
    "threshold": ThresholdPolicy,
    "disable_by_batch": DisableByBatchPolicy,
    "hf_heuristic": HfHeuristicPolicy,
    "goodput": GoodputPolicy,
}


def import_policy_class(target: str) -> type[Policy]:
    """The class named by ``"package.module.ClassName"``; it must subclass :class:`Policy`."""
    module_name, _, class_name = target.rpartition(".")
    if not module_name:
        raise ValueError(f"policy _target_ must be 'package.module.ClassName', got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"policy _target_ {target!r}: cannot import module {module_name!r} ({e})") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"policy _target_ {target!r}: module {module_name!r} has no {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"policy _target_ {target!r} is not a subclass of specsched.policies.base.Policy")
    return cls


def _plain(cfg) -> dict:
    """A plain dict of ``cfg`` (also from an omegaconf DictConfig)."""
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # omegaconf comes with hydra; a plain dict needs neither
        DictConfig = None
    if DictConfig is not None and isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(cfg, Mapping):
        raise ValueError(
            f"policy config must be a mapping like {{'name': 'goodput', ...}}, got {type(cfg).__name__}"
        )
    return dict(cfg)


def build_policy(cfg: Mapping) -> Policy:
    """Build a policy from ``{"name": "goodput", **options}`` or ``{"_target_": "pkg.mod.Class",
    **options}``. Options go to the class's ``config_cls`` dataclass (``cls(config_cls(**options))``);
    a class without ``config_cls`` gets them as keyword arguments. With ``_target_``, an optional
    ``name`` overrides the instance's ``name`` (what plans and the log record)."""
    options = _plain(cfg)
    target, name = options.pop("_target_", None), options.pop("name", None)
    if target is not None:
        cls = import_policy_class(str(target))
        label = str(target)
    elif name is None:
        raise ValueError(f"policy config needs 'name' (one of {', '.join(POLICIES)}) or '_target_'")
    elif name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)} (or give '_target_')")
    else:
        cls, label = POLICIES[name], name
    config_cls = getattr(cls, "config_cls", None)
    if config_cls is not None and dataclasses.is_dataclass(config_cls):
        known = [f.name for f in dataclasses.fields(config_cls) if f.init]
        unknown = [k for k in options if k not in known]
        if unknown:
            raise ValueError(f"unknown option {unknown[0]!r} for policy {label!r}; known: {', '.join(known)}")
        policy = cls(config_cls(**options))
    else:
        try:
            policy = cls(**options)
        except TypeError as e:
            raise ValueError(f"bad options {sorted(options)} for policy {label!r}: {e}") from e
    if target is not None and name is not None:
        policy.name = str(name)
    return policy
