"""Every ``bench=<preset>`` of bench/conf/bench composes, and its serve section (where enabled) passes
ServeConfig's checks: a preset broken by a renamed key or a bad value fails here, not on the H200."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import specsched.bench.cli as cli
from specsched.bench.e2e import policy_configs
from specsched.bench.serve_config import ServeConfig

CONF_DIR = Path(cli.__file__).parent / "conf"
PRESETS = sorted(p.stem for p in (CONF_DIR / "bench").glob("*.yaml"))


def test_the_presets_are_found() -> None:
    assert {"serve", "serve_rounds", "serve_det_rounds", "regret"} <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_and_its_serve_section_validates(preset: str) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("bench", overrides=[f"bench={preset}"]).bench
    if cfg.regret.enabled:  # every variant's scheduler options are known and valid (policy_configs)
        for section in (cfg.regret.synthetic, cfg.regret.real):
            assert policy_configs(section, list(section.scorers)), preset
    if cfg.serve.enabled:
        serve = ServeConfig.from_dictconfig(cfg.serve)
        assert serve.configs, preset
        for run in serve.configs:  # every reference names a config of the grid (checked on build)
            assert run.reference is None or run.reference in {c.name for c in serve.configs}
