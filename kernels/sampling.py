"""Sampling: logits -> probabilities (temperature, top-k, top-p) and inverse-CDF sampling.

Everything is vectorised over rows; rows carry their own sampling parameters through
:class:`SamplingTensors` (one row per scored position, so request i's parameters are repeated
``k_i + 1`` times when its proposals are verified). The same :func:`logits_to_probs` must be
used for the target and for a draft model's probabilities (same temperature / top-k / top-p),
otherwise rejection sampling is lossless with respect to the wrong distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsched.engine.request import SamplingParams


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device. ``top_k == 0`` and ``top_p == 1`` mean off;
    greedy rows (``temperature == 0``) become one-hot at the argmax."""

    temperature: torch.Tensor  # [T] float32
    top_k: torch.Tensor  # [T] int64
    top_p: torch.Tensor  # [T] float32
    is_greedy: torch.Tensor  # [T] bool
    # host flags (no device sync): False lets logits_to_probs skip the vocab sort
    has_top_k: bool = True
    has_top_p: bool = True

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @staticmethod
    def from_params(
        params: list[SamplingParams],
        repeats: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Request i's parameters repeated ``repeats[i]`` times (default once each)."""
        if repeats is None:
            repeats = [1] * len(params)
        if len(repeats) != len(params):
            raise ValueError(f"repeats has {len(repeats)} entries for {len(params)} sampling params")
        if any(r < 0 for r in repeats):
            raise ValueError(f"repeats must be >= 0, got {repeats}")
        temperature, top_k, top_p, is_greedy = [], [], [], []
        for sp, r in zip(params, repeats, strict=True):
            temperature += [float(sp.temperature)] * r
            top_k += [int(sp.top_k)] * r
            top_p += [float(sp.top_p)] * r
            is_greedy += [sp.is_greedy] * r
        sampled = [sp for sp, r in zip(params, repeats, strict=True) if r > 0 and not sp.is_greedy]

        def upload(values: list, dtype: torch.dtype) -> torch.Tensor:  # built on the host, no sync
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return SamplingTensors(
            temperature=upload(temperature, torch.float32),
            top_k=upload(top_k, torch.int64),
            top_p=upload(top_p, torch.float32),
            is_greedy=upload(is_greedy, torch.bool),
            has_top_k=any(sp.top_k > 0 for sp in sampled),
            has_top_p=any(sp.top_p < 1.0 for sp in sampled),
        )


def _top_k_top_p_threshold(
    scaled: torch.Tensor,  # [T, V] float32, temperature-scaled logits
    top_k: torch.Tensor,  # [T] int64, 0 = off
    top_p: torch.Tensor,  # [T] float32, 1 = off
) -> torch.Tensor:  # [T, 1]: keep logits >= threshold
    """Smallest logit value each row keeps after top-k then top-p (nucleus, Holtzman et al. 2020).

    Thresholds are values, not ranks, so tokens tied with the last kept one are kept too and the
    result does not depend on the sort's tie order. Top-p is applied to the top-k-renormalised
    distribution: keep the smallest prefix (by descending probability) whose mass is >= top_p;
    the top token is always kept.
    """
    num_rows, vocab = scaled.shape
    sorted_vals, _ = scaled.sort(dim=-1, descending=True)  # [T, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_vals.gather(1, (k - 1).unsqueeze(1))  # [T, 1]
    sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, float("-inf"))
    sorted_probs = sorted_vals.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [T, V] exclusive cumsum
    keep = (mass_before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    num_keep = keep.sum(dim=-1, keepdim=True)  # >= 1: mass_before[:, 0] == 0 < top_p
    nucleus = sorted_vals.gather(1, num_keep - 1)  # [T, 1]
    return torch.maximum(kth, nucleus)


def logits_to_probs(
    logits: torch.Tensor,  # [T, V]
    st: SamplingTensors,
) -> torch.Tensor:  # [T, V] float32
    """Temperature, top-k, top-p, softmax; greedy rows become one-hot at the argmax."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[0] != st.num_rows:
        raise ValueError(f"logits has {logits.shape[0]} rows, sampling tensors {st.num_rows}")
    logits = logits.float()
    temperature = torch.where(st.is_greedy, torch.ones_like(st.temperature), st.temperature)
    scaled = logits / temperature.unsqueeze(1)
    if st.has_top_k or st.has_top_p:
        threshold = _top_k_top_p_threshold(scaled, st.top_k, st.top_p)
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    probs = scaled.softmax(dim=-1)
    greedy = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(st.is_greedy.unsqueeze(1), greedy, probs)


def sample_from_probs(
    probs: torch.Tensor,  # [T, V] non-negative, rows need not be normalised
    uniforms: torch.Tensor,  # [T] in [0, 1)
) -> torch.Tensor:  # [T] int64
    """Inverse-CDF sampling, one uniform per row: the first token whose cumulative mass exceeds
    ``u * row_sum``. That token always has nonzero probability; ``u`` rounding up to the row sum
    falls back to the last token with nonzero probability. Rows must have positive mass."""
    if probs.dim() != 2:
        raise ValueError(f"probs must be [num_rows, vocab], got shape {tuple(probs.shape)}")
    if uniforms.shape != (probs.shape[0],):
        raise ValueError(f"uniforms must be [{probs.shape[0]}], got shape {tuple(uniforms.shape)}")
    cdf = probs.float().cumsum(dim=-1)  # [T, V] non-decreasing
    target = uniforms.to(cdf.dtype).unsqueeze(1) * cdf[:, -1:]  # [T, 1]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)  # first index with cdf > target
    last_nonzero = (probs > 0).cumsum(dim=-1).argmax(dim=-1)  # first index reaching the max count
    return torch.where(tokens >= probs.shape[1], last_nonzero, tokens)
