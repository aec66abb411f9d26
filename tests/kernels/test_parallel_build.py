"""Parallel compile workers (kernels/parallel_build.py): real worker processes, run here under the
Triton interpreter on CPU (nothing is compiled, but each worker launches its share of the configs and
reports them); a failing worker is reported and does not raise."""

from __future__ import annotations

import os

import pytest

from specsched.kernels.attention_variants import AttentionDomain, launch_configs
from specsched.kernels.parallel_build import CacheShape, build_in_workers, marker_path, shard


def test_shard_round_robin_covers_every_item_once() -> None:
    items = list(range(11))
    parts = shard(items, 4)
    assert len(parts) == 4 and sorted(x for p in parts for x in p) == items
    assert parts[0] == [0, 4, 8]
    assert shard(items[:2], 8) == [[0], [1]]  # never an empty worker
    assert shard([], 8) == []


def test_cache_shape_rejects_a_bad_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        CacheShape(4, 2, 16, 16, "int8")


def _configs(n: int) -> list:
    d = AttentionDomain(4, 2, 16, max_rows_single=8, max_rows_multi=4, max_q=40, max_keys=200)
    configs = list(launch_configs(d, num_sms=4))
    assert len(configs) >= n
    return configs[:n]


def test_workers_launch_every_config_and_report_progress(tmp_path) -> None:
    configs = _configs(3)
    seen = []
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp_path)}
    shape = CacheShape(4, 2, 16, 16, "float32", "cpu")
    report = build_in_workers(configs, shape, 2, seen.append, env=env)
    assert report.failures == []
    assert report.num_workers == 2 and not report.is_cached
    assert report.num_launched == report.num_configs == 3 == len(seen)
    assert report.is_complete
    assert marker_path(configs, shape, env).exists()
    again = build_in_workers(configs, shape, 2, env=env)  # a warm start: the marker, no workers
    assert again.is_cached and again.num_workers == 0 and again.is_complete
    other = build_in_workers(configs[:2], shape, 2, env=env)  # other configs: built, not skipped
    assert not other.is_cached and other.num_workers == 2


def test_a_failing_worker_is_reported_not_raised(tmp_path) -> None:
    configs = _configs(2)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "TRITON_CACHE_DIR": str(tmp_path),
    }
    shape = CacheShape(4, 2, 16, 16, "float32", "cuda")  # no CUDA visible: the workers fail
    report = build_in_workers(configs, shape, 2, env=env)
    assert not report.is_complete
    assert report.num_launched == 0
    assert len(report.failures) == 2
    assert all("exit 1" in f for f in report.failures)
    assert not marker_path(configs, shape, env).exists()  # an incomplete build leaves no marker


@pytest.mark.parametrize("module", ["triton_attention", "triton_attention_kernels"])
def test_a_change_to_the_wrappers_or_the_kernels_is_a_new_build(tmp_path, monkeypatch, module) -> None:
    """The marker's key hashes both source files: an edited kernel must not find the old build."""
    import importlib
    import shutil

    configs, shape = _configs(1), CacheShape(4, 2, 16, 16, "float32", "cpu")
    env = {"TRITON_CACHE_DIR": str(tmp_path)}
    before = marker_path(configs, shape, env)
    mod = importlib.import_module(f"specsched.kernels.{module}")
    edited = tmp_path / f"{module}.py"
    shutil.copy(mod.__file__, edited)
    edited.write_text(edited.read_text() + "\n# edited\n")
    monkeypatch.setattr(mod, "__file__", str(edited))
    assert marker_path(configs, shape, env) != before
