"""The installed ``specsched-bench`` console script finds its configs from any directory (its config
module was not importable from an editable install until bench/conf became a package)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

BIN = os.path.dirname(sys.executable)


@pytest.mark.parametrize("preset", ["serve_tiny", "serve_det_rounds"])
def test_specsched_bench_cfg_job_resolves_a_preset_from_another_directory(tmp_path, preset: str) -> None:
    exe = os.path.join(BIN, "specsched-bench")
    entry = "from specsched.bench.cli import main; main()"
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-c", entry]
    r = subprocess.run([*cmd, f"bench={preset}", "bench.serve.rounds=2", "--cfg", "job"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)["bench"]
    assert cfg["serve"]["enabled"] is True and cfg["serve"]["rounds"] == 2
    assert os.listdir(tmp_path) == []  # --cfg job runs nothing
