"""PNG charts of a replay (matplotlib, Agg backend: no display needed).

- ``k_over_time.png``: mean k per decode step, one line per row of the table.
- ``scorer_vs_batch.png``: per row, the share of its steps that used each scorer, by batch size.
- ``predicted_vs_measured.png``: the recorded decode steps' measured ms against the refitted cost
  model's prediction (and the online prediction the log holds, where it has one).
"""

from __future__ import annotations

import os
from collections import Counter

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specsched.policies.replay import PolicyResult, ReplayReport  # noqa: E402

FILES = ("k_over_time.png", "scorer_vs_batch.png", "predicted_vs_measured.png")


def _name(r: PolicyResult) -> str:
    return f"{r.label} ({r.source})"


def plot_k_over_time(rows: list[PolicyResult], path: str) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in rows:
        ax.plot(range(len(r.trace)), [t.mean_k for t in r.trace], label=_name(r), linewidth=1.2)
    ax.set_xlabel("decode step")
    ax.set_ylabel("mean k over the batch")
    ax.set_title("k over time")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_scorer_vs_batch(rows: list[PolicyResult], scorers: list[str], path: str) -> None:
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.8 * len(rows) + 1), sharex=True, squeeze=False)
    names = sorted(set(scorers) | {t.scorer for r in rows for t in r.trace})
    batches = sorted({t.batch_size for r in rows for t in r.trace}) or [1]
    for ax, r in zip(axes[:, 0], rows, strict=True):
        by_batch = {b: Counter(t.scorer for t in r.trace if t.batch_size == b) for b in batches}
        bottom = [0.0] * len(batches)
        for name in names:
            share = [by_batch[b][name] / max(sum(by_batch[b].values()), 1) for b in batches]
            ax.bar(batches, share, bottom=bottom, label=name, width=0.8)
            bottom = [x + y for x, y in zip(bottom, share, strict=True)]
        ax.set_ylim(0, 1)
        if len(batches) <= 24:
            ax.set_xticks(batches)
        ax.set_ylabel("share", fontsize=8)
        ax.set_title(_name(r), fontsize=8)
    axes[0, 0].legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("batch size")
    fig.suptitle("scorer choice vs batch size")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_predicted_vs_measured(report: ReplayReport, path: str) -> None:
    recorded = next(r for r in report.rows if r.source == "recorded")
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    measured = [t.measured_ms for t in recorded.trace]
    ax.scatter([t.predicted_ms for t in recorded.trace], measured, s=10, label="refitted model")
    online = [(s.predicted_ms, s.cost_ms) for s in report.run.decode_steps if s.predicted_ms is not None]
    if online:
        ax.scatter(*zip(*online, strict=True), s=10, marker="x", alpha=0.6, label="online model (as logged)")
    top = max([*measured, *(p for p, _ in online), *(t.predicted_ms for t in recorded.trace), 1e-3])
    ax.plot([0, top], [0, top], color="gray", linewidth=0.8, label="predicted = measured")
    ax.set_xlabel("predicted step ms")
    ax.set_ylabel("measured step ms")
    ax.set_title("predicted vs measured step time")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(report: ReplayReport, out: str) -> list[str]:
    """Write the three charts to folder ``out`` (created); returns their paths."""
    os.makedirs(out, exist_ok=True)
    rows = [r for r in report.rows if r.error is None]
    paths = [os.path.join(out, f) for f in FILES]
    plot_k_over_time(rows, paths[0])
    plot_scorer_vs_batch(rows, report.run.settings.scorers, paths[1])
    plot_predicted_vs_measured(report, paths[2])
    return paths
