"""Decision logs as a run's bundle holds them: SQLite files, gzipped (bench/run_gpu.sh ``bundle``)."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path


def plain_log(path: Path, into: Path) -> Path:
    """``path`` itself when it is a plain SQLite log; a ``.gz`` one decompressed to ``into`` under its
    name without ``.gz`` (once: a copy already there is used as it is)."""
    path = Path(path)
    if path.suffix != ".gz":
        return path
    plain = Path(into) / path.stem
    if not plain.is_file():
        with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return plain
