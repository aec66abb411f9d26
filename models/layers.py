"""The Llama model's building blocks: its linear layer (default, batch-invariant or small-M kernel),
RMSNorm (with the fused residual add) and RoPE's inverse frequencies."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specsched.kernels.batch_invariant_matmul import batch_invariant_linear
from specsched.kernels.fused_linear import FUSED_MAX_ROWS
from specsched.kernels.norm import add_rms_norm, rms_norm
from specsched.kernels.small_linear import small_linear
from specsched.kernels.triton_utils import is_interpreted
from specsched.models.config import LlamaConfig


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, names and default forward); with ``deterministic`` set it runs
    the batch-invariant matmul (row i of the output independent of the other rows); with
    ``is_small_m`` set, forwards of at most ``FUSED_MAX_ROWS`` rows on CUDA run the small-M Triton
    kernel (``model.fused_linear_gemms``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, deterministic: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.deterministic = deterministic
        self.is_small_m = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.deterministic:
            return batch_invariant_linear(x, self.weight, self.bias)
        if self.is_small_m and x.shape[0] <= FUSED_MAX_ROWS and (x.is_cuda or is_interpreted()):
            return small_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich, 2019): ``w * x / sqrt(mean(x^2) + eps)``, in float32, rounded to
    the model dtype before the weight multiply (as HF Llama)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim]
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, residual_out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), fused; the sum written to ``residual_out`` when given."""
        return add_rms_norm(x, residual, self.weight, self.eps, residual_out=residual_out)


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:  # [head_dim // 2]
    """Rotary inverse frequencies, with Llama-3 frequency scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "llama3":
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_len = rs.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, llama3")
    return inv.float()
