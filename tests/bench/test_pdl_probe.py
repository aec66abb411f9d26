"""bench/pdl_probe.py: its GEMV chain computes what torch does (the probe's timings are only worth
reading if the kernel is right); the PDL variants need a Hopper GPU and run there only."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from specsched.bench.pdl_probe import gemv


def test_the_chain_matches_torch_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "specsched.bench.pdl_probe"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    m = re.search(r"max \|diff\| ([0-9.e+-]+)", out.stdout)
    assert m, out.stdout
    assert float(m.group(1)) < 1e-4


def test_gemv_names_a_shape_mismatch():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="gemv: x"):
        gemv(torch.zeros(15), w, torch.zeros(8))
    with pytest.raises(ValueError, match="gemv: x"):
        gemv(torch.zeros(16), w, torch.zeros(9))
