"""Host-side integer helpers of the kernel wrappers against Triton's own."""

from __future__ import annotations

import triton

from specsched.kernels.attention_config import launch_config
from specsched.kernels.triton_utils import cdiv, next_pow2


def test_cdiv_and_next_pow2_match_triton() -> None:
    for n in range(0, 5000):
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_launch_config_is_cached_and_still_follows_its_arguments() -> None:
    a = launch_config(4, 550, 1, 1, 32, 128, num_sms=132)
    assert launch_config(4, 550, 1, 1, 32, 128, num_sms=132) is a
    b = launch_config(4, 4000, 1, 1, 32, 128, num_sms=132)  # longer keys: more splits
    assert b.num_splits > a.num_splits
    assert launch_config(1, 550, 64, 1, 32, 128, num_sms=132).num_splits == 1  # full grid: no split
