"""bench/pdl_forward.py on the CPU: it refuses to run without a Hopper GPU, and its modes are the
kernel modes they name (the timings themselves run on the GPU only)."""

from __future__ import annotations

import pytest
import torch

from specsched.bench.pdl_forward import main, mode_of
from specsched.kernels.pdl import PdlMode


def test_without_a_hopper_gpu_it_says_so_and_exits_2(capsys):
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("a Hopper GPU is here")
    assert main(["--models", "smollm2"]) == 2
    assert "compute capability >= 9.0" in capsys.readouterr().err


def test_each_mode_is_the_kernel_mode_it_names():
    assert mode_of("after", 4.0) == PdlMode(on=True, trigger="after", prefetch_max_mb=4.0)
    assert mode_of("before", 4.0) == PdlMode(on=True, trigger="before", prefetch_max_mb=4.0)
    assert mode_of("before_all", 4.0) == PdlMode(on=True, trigger="before", prefetch_max_mb=float("inf"))
    with pytest.raises(ValueError, match="unknown PDL mode 'sideways'; known: after, before, before_all"):
        mode_of("sideways", 4.0)
