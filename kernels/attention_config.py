"""Tile sizes and key splits of one Triton attention launch (kernels/triton_attention.py), from host
upper bounds only: the default config (tiles by group and head size, flash-decoding splits when the
grid would leave SMs idle) and deterministic mode's (every tile size from (group, head_dim) alone,
keys split at fixed positions)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from specsched.kernels.triton_utils import cdiv, next_pow2

DETERMINISTIC_SPLIT_KEYS = 256  # keys per split in deterministic mode: fixed positions, every launch


@dataclass(frozen=True)
class LaunchConfig:
    block_q: int  # query tokens per program
    group_pad: int  # query heads per KV head, rounded up to a power of two
    block_n: int  # keys per inner step
    block_d: int  # head_dim rounded up to a power of two (>= 16)
    num_splits: int  # key chunks per (row, q-tile, kv-head), merged by a second kernel when > 1
    num_warps: int
    num_stages: int
    split_keys: int = 0  # > 0: deterministic mode, splits at fixed multiples of split_keys keys

    @property
    def block_m(self) -> int:
        return self.block_q * self.group_pad

    @property
    def is_deterministic(self) -> bool:
        return self.split_keys > 0


@functools.lru_cache(maxsize=4096)  # every layer of a forward asks with the same bounds
def launch_config(
    max_q: int,
    max_k: int,
    num_rows: int,
    group: int,
    kv_heads: int,
    head_dim: int,
    *,
    num_sms: int = 132,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    deterministic: bool = False,
) -> LaunchConfig:
    """Tile sizes for one launch, from host upper bounds only. ``tl.dot`` needs dimensions >= 16.

    ``deterministic``: :func:`deterministic_launch_config` (the overrides above are then ignored).

    Keys are split (flash-decoding) when the (row, q-tile, kv-head) grid has fewer programs than
    SMs, at most one split per ``block_n`` keys. Defaults picked from a sweep on an H200 (bf16,
    head_dim 128, 32 heads, block 16, CUDA-graph replay), e.g. one decode row over 550 keys
    7.3 us (13.8 unsplit), 64 rows x 4 queries x 2048 keys 0.49 ms and 256 decode rows x 2048
    keys 1.92 ms, i.e. about 4.4 TB/s of KV reads.
    """
    if deterministic:
        return deterministic_launch_config(max_k, group, head_dim)
    group_pad = next_pow2(group)
    block_d = max(16, next_pow2(head_dim))
    target_m = 64 if block_d <= 128 else 32
    block_q = min(next_pow2(max(max_q, 1)), max(1, target_m // group_pad))
    block_q = max(block_q, 16 // group_pad, 1)
    programs = max(num_rows, 1) * cdiv(max(max_q, 1), block_q) * kv_heads
    half_full = num_sms // 2 <= programs < num_sms  # splits help, but long tiles do not
    if block_n is None:
        small_m = block_q * group_pad <= 32
        block_n = (128 if small_m and not half_full else 64) if block_d <= 128 else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        num_splits = min(cdiv(2 * num_sms, programs), cdiv(max(max_k, 1), block_n), 16)
    num_splits = max(num_splits, 1)
    if num_warps is None:
        num_warps = 8 if block_q * group_pad * block_d >= 128 * 128 else 4
    if num_stages is None:
        num_stages = 1 if num_splits > 1 and not half_full else 2
    return LaunchConfig(block_q, group_pad, block_n, block_d, num_splits, num_warps, num_stages)


@functools.lru_cache(maxsize=256)
def deterministic_launch_config(
    max_k: int, group: int, head_dim: int, split_keys: int = DETERMINISTIC_SPLIT_KEYS
) -> LaunchConfig:
    """Deterministic mode's config: every tile size from (group, head_dim) alone, keys split at fixed
    multiples of ``split_keys`` (one split when ``max_k`` fits one). Only ``num_splits`` follows the
    launch, and it is a runtime argument of the kernel: two compiled variants (unsplit, split) and
    one merge kernel per (group, head_dim, dtype), whatever the batch. One query tile of 16 matrix
    rows (decode rows waste least; a prefill chunk takes more tiles), one key tile of 64 (32 for
    head_dim > 128)."""
    group_pad = next_pow2(group)
    block_d = max(16, next_pow2(head_dim))
    block_n = 64 if block_d <= 128 else 32
    if split_keys < block_n or split_keys % block_n:
        raise ValueError(
            f"split_keys must be a positive multiple of the key tile {block_n}, got {split_keys}"
        )
    num_splits = cdiv(max(max_k, 1), split_keys)
    block_q = max(1, 16 // group_pad)
    return LaunchConfig(block_q, group_pad, block_n, block_d, num_splits, 4, 2, split_keys)


def deterministic_launch_configs(group: int, head_dim: int) -> list[LaunchConfig]:
    """The deterministic-mode configs that compile distinct kernels (the split count is a runtime
    value): unsplit and split; for a start-up warm-up."""
    return [
        deterministic_launch_config(1, group, head_dim),
        deterministic_launch_config(DETERMINISTIC_SPLIT_KEYS + 1, group, head_dim),
    ]
