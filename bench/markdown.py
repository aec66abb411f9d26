"""Markdown table helpers shared by the bench reports."""

from __future__ import annotations

import math
import sys


def fmt(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def log_name(path: str) -> str:
    """A decision log's name in a report: its file name without ``.sqlite``."""
    return path.rsplit("/", 1)[-1].removesuffix(".sqlite")


def emit(text: str, out: str | None = None) -> None:
    """A report to stdout, and to the file ``out`` too when given (the CLIs' ``--out``)."""
    sys.stdout.write(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
