"""Our parameter names against HF ``LlamaForCausalLM``'s: HF's separate q/k/v and gate/up projections
are fused into one weight each on load (one GEMM instead of several) and split back for export."""

from __future__ import annotations

import torch
from torch import nn


def fuse_on_load(
    state: dict, prefix: str, fused: str, parts: tuple[str, ...], suffixes: tuple[str, ...]
) -> None:
    """Load-time hook: concatenate HF's separate projections (``q_proj``/``k_proj``/``v_proj``,
    ``gate_proj``/``up_proj``) into one fused weight, so a layer runs one GEMM instead of several."""
    for suffix in suffixes:
        names = [f"{prefix}{part}.{suffix}" for part in parts]
        if all(n in state for n in names):
            state[f"{prefix}{fused}.{suffix}"] = torch.cat([state.pop(n) for n in names], dim=0)


def hf_parameter_names(name: str) -> list[str]:
    """The HF checkpoint names a parameter of ours is loaded from (the fused ones come from several)."""
    for fused, parts in (
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    ):
        if f".{fused}." in name:
            return [name.replace(f".{fused}.", f".{part}.") for part in parts]
    return [name]


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under HF checkpoint names: the fused projections split back into
    ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` (views, no copies)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        names = hf_parameter_names(name)
        if len(names) == 1:
            out[name] = t
            continue
        mod = model.get_submodule(name.rsplit(".", 2)[0])
        sizes = [mod.q_size, mod.kv_size, mod.kv_size] if len(names) == 3 else [t.shape[0] // 2] * 2
        out.update(zip(names, t.split(sizes, dim=0)))
    return out
