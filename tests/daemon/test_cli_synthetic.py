"""``proposer.synthetic_oracle`` composes through hydra and maps onto the engine config."""

from __future__ import annotations

import pytest

from specsched.daemon.app_config import AppConfig
from specsched.daemon.cli import register_configs, resolve, to_engine_config

TINY = ["model=tiny", "cache.num_blocks=64", "model.device=cpu"]


def compose_app(overrides: list[str]) -> AppConfig:
    from hydra import compose, initialize_config_module

    register_configs()
    with initialize_config_module("specsched.conf", version_base="1.3"):
        return resolve(compose("config", overrides=overrides))


def test_synthetic_oracle_maps_onto_the_engine_config():
    app = compose_app([*TINY, "proposer=synthetic", "proposer.synthetic_oracle=/x.json"])
    assert app.proposer.name == "synthetic" and app.proposer.synthetic_oracle == "/x.json"
    spec = to_engine_config(app).spec
    assert (spec.proposer, spec.synthetic_oracle) == ("synthetic", "/x.json")


def test_synthetic_oracle_defaults_to_none():
    assert to_engine_config(compose_app([*TINY, "proposer=synthetic"])).spec.synthetic_oracle is None


def test_empty_synthetic_oracle_is_rejected():
    with pytest.raises(ValueError, match="proposer.synthetic_oracle"):
        compose_app([*TINY, "proposer=synthetic", "proposer.synthetic_oracle=''"])
