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


def test_env_txt_says_when_the_tree_is_not_its_head(tmp_path):
    """The device copies the working tree, not always its git metadata: env.txt flags a HEAD whose
    tracked files differ from the tree that ran (a stale HEAD named the wrong commit on 2026-12-06)."""
    import shutil

    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    for name in ("run_gpu.sh", "gpu_env.sh"):
        shutil.copy(ROOT / "bench" / name, repo / "bench" / name)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], cwd=repo, check=True)

    def env_txt() -> str:
        out = tmp_path / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        env = {"OUT": str(out), "SKIP_TESTS": "1", "SKIP_BENCH": "1", "PATH": "/usr/bin:/bin"}
        subprocess.run(["bash", "bench/run_gpu.sh"], cwd=repo, env=env, check=True, capture_output=True,
                       timeout=120)  # fmt: skip
        return (out / "env.txt").read_text()

    assert "differs from that HEAD" not in env_txt()
    (repo / "bench" / "gpu_env.sh").write_text((repo / "bench" / "gpu_env.sh").read_text() + "\n# edited\n")
    assert "differs from that HEAD in 1 tracked files" in env_txt()
