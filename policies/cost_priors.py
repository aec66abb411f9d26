"""Seed coefficients of the online cost models, per device, and the floors of their prior spread.

A model starts at its seed (:func:`seed_coefficients`) with a prior std of ``prior_rel_std`` times
``max(|seed|, FLOOR)`` per feature (weak: a few steps move it); the features are those of
:mod:`specsched.policies.shapes`.
"""

from __future__ import annotations

from specsched.policies.shapes import FEATURES

__all__ = ["FLOOR", "PRIORS", "seed_coefficients"]

FLOOR = {  # smallest prior std scale per feature (ms per unit) so unseeded features still learn
    "score": [1.0, 0.01, 0.01, 0.01, 0.01, 1.0],
    "propose": [0.1, 0.1, 0.01, 0.01],
    "verify": [0.1, 0.001],
    "overhead": [0.1, 0.01],
}
# Seed coefficients ("*" = any other name). cpu: the tiny / 135M models in float32 on a few cores;
# cuda: llama2-7b on an H200, least squares over the 2026-12-02 scorer table of docs/benchmarks.md
# (graph scorers 8.2 ms + 0.036 ms per batch-expansion row + 0.066 ms per row per 1k context, or +
# 0.023 ms per MQA token + 0.07 ms per 1k context; eager MQA ~24 ms), the llama-68m draft at ~0.9 ms
# per forward with its host work (the bench's synthetic proposer runs it too), host overhead 0.8 ms
# + 0.15 ms per request (its non-speculative end-to-end rows).
PRIORS: dict[str, dict] = {
    "cpu": {
        "score": {
            "batch_expansion": [2.0, 0.05, 0.2, 0.01, 0.02, 0.0],
            "mqa": [2.0, 0.05, 0.2, 0.01, 0.01, 0.0],
            "*": [2.0, 0.05, 0.2, 0.01, 0.02, 0.0],
        },
        "propose": {
            "draft": [0.2, 0.6, 0.05, 0.0],
            "ngram": [0.05, 0.0, 0.0, 0.002],
            "*": [0.05, 0.0, 0.0, 0.01],
        },
        "verify": [0.05, 0.005],
        "overhead": [0.3, 0.02],
    },
    "cuda": {
        "score": {
            "batch_expansion": [8.2, 0.036, 0.0, 0.0, 0.066, 15.0],
            "mqa": [24.0, 0.0, 0.02, 0.07, 0.0, 0.0],
            "mqa_graph": [8.2, 0.0, 0.023, 0.07, 0.0, 15.0],
            "*": [15.0, 0.0, 0.02, 0.1, 0.05, 0.0],
        },
        "propose": {
            "draft": [0.3, 0.9, 0.005, 0.01],
            "synthetic": [0.3, 0.9, 0.005, 0.01],
            "ngram": [0.05, 0.0, 0.0, 0.001],
            "*": [0.05, 0.0, 0.0, 0.001],
        },
        "verify": [0.1, 0.002],
        "overhead": [0.8, 0.15],
    },
}


def seed_coefficients(device: str, key: tuple[str, ...]) -> list[float]:
    """The seed of model ``key`` (``("score", scorer)``, ``("propose", proposer)``, ``("verify",)``,
    ``("overhead",)``) on ``device``. A mixed batch's proposer label joins its proposers with "+":
    their costs add up ("none" costs nothing)."""
    table = PRIORS[device][key[0]]
    if not isinstance(table, dict):
        return list(table)
    if key[0] == "score":
        return list(table.get(key[1], table["*"]))
    parts = [table.get(name, table["*"]) for name in key[1].split("+") if name != "none"]
    return [sum(c) for c in zip(*parts, strict=True)] if parts else [0.0] * len(FEATURES["propose"])
