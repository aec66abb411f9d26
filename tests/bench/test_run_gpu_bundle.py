"""bench/run_gpu.sh with ``BUNDLE=1`` leaves at most 8 files under $OUT (what a device call brings back):
summary.txt and out.tar.part_*, from which everything it wrote comes back, decision logs gzipped."""

from __future__ import annotations

import gzip
import io
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bundle_leaves_few_files_that_hold_everything(tmp_path):
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    log = bytes(range(256)) * 400  # a "decision log" to come back gzipped
    (out / "logs" / "goodput.sqlite").write_bytes(log)
    (out / "bench").mkdir()
    (out / "bench" / "tables.md").write_text("| a |\n")
    env = {"OUT": str(out), "BUNDLE": "1", "SKIP_TESTS": "1", "SKIP_BENCH": "1", "PATH": "/usr/bin:/bin"}
    subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh")], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    names = sorted(p.name for p in out.iterdir())
    assert len(names) <= 8 and "summary.txt" in names and "tables.md" in names
    parts = sorted(out.glob("out.tar.part_*"))
    assert parts and all(p.is_file() for p in out.iterdir())  # no folders left
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers()}
        assert "logs/goodput.sqlite" not in members
        assert gzip.decompress(tar.extractfile(members["logs/goodput.sqlite.gz"]).read()) == log
        assert tar.extractfile(members["bench/tables.md"]).read() == b"| a |\n"
        assert "summary.txt" in members and "env.txt" in members


def test_without_bundle_the_files_stay(tmp_path):
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "a.sqlite").write_bytes(b"x")
    env = {"OUT": str(out), "SKIP_TESTS": "1", "SKIP_BENCH": "1", "PATH": "/usr/bin:/bin"}
    subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh")], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    assert (out / "logs" / "a.sqlite").read_bytes() == b"x" and not list(out.glob("out.tar.part_*"))
