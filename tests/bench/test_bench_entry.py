"""How the benchmarks are started: the installed ``specsched-bench`` console script finds its configs
from any directory (its config module was not importable from an editable install until bench/conf
became a package), and bench/run_gpu.sh maps every package of the project on the H200."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
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


def test_run_gpu_maps_every_package_of_the_project() -> None:
    """bench/run_gpu.sh and bench/lease.sh import the tree through a folder of symlinks
    (``specsched/<dir>``, bench/gpu_env.sh), not an install: a package missing from its list fails
    only on the H200 (``specsched.gateway`` was, until 07fd02b)."""
    root = Path(__file__).resolve().parents[2]
    mapped = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    top = {d for d in mapped.values() if "/" not in d}  # specsched.<x> = "<x>"
    line = next(x for x in (root / "bench" / "gpu_env.sh").read_text().splitlines() if "for d in" in x)
    linked = set(re.search(r"for d in ([\w ]+); do", line).group(1).split())
    assert linked == top, (sorted(top - linked), sorted(linked - top))
