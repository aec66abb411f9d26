"""Random weights for the presets: tests (``init_random``) and GPU timing runs, whose greedy choices
must survive bf16 noise (``make_decisive``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specsched.models.llama import LlamaForCausalLM


def init_random(model: LlamaForCausalLM, seed: int = 0, std: float = 0.02) -> LlamaForCausalLM:
    """Deterministic random init (presets for tests and GPU timing)."""
    dev = model.lm_head.weight.device
    g = torch.Generator(device=dev).manual_seed(seed)  # drawn where the weights live (fast at 7B on GPU)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, device=dev, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * r if "norm" in name else r * std)
    return model


def make_decisive(model: LlamaForCausalLM, seed: int = 0, margin: float = 20.0) -> LlamaForCausalLM:
    """Timing presets only: give random weights decisive greedy choices, so that bf16 rounding in a
    different row layout (batch expansion vs MQA, another k) cannot flip a near-tie and move a request
    off the synthetic proposer's oracle path. The layers' output projections are scaled down so the
    residual stream stays close to the token's embedding, and the LM head's rows are a permutation of
    the embedding rows, so the next token is ``perm^-1(token)`` by a wide margin (|e|^2 against cross
    terms ~|e|^2 / sqrt(hidden)). The scale is set from the weights: a sublayer adds about
    rms(w_in) sqrt(d_in) * rms(w_out) sqrt(d_mid) per element, 2L of them add up like a random walk,
    and their sum is kept ``margin`` times below the embedding's rms (a fixed scale that works for 4
    layers of 256 is 8x too weak at 32 layers of 4096). Compute and bytes moved are unchanged."""
    emb = model.model.embed_tokens.weight
    g = torch.Generator(device=emb.device).manual_seed(seed)

    def rms(w: torch.Tensor) -> float:
        return w.float().pow(2).mean().sqrt().item()

    with torch.no_grad():
        gains = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            w_v, w_o = attn.qkv_proj.weight[attn.q_size + attn.kv_size :], attn.o_proj.weight
            w_u, w_d = mlp.gate_up_proj.weight[mlp.down_proj.weight.shape[1] :], mlp.down_proj.weight
            gains.append(rms(w_v) * w_v.shape[1] ** 0.5 * rms(w_o) * w_o.shape[1] ** 0.5)
            gains.append(rms(w_u) * w_u.shape[1] ** 0.5 * rms(w_d) * w_d.shape[1] ** 0.5)
        noise = (sum(x * x for x in gains)) ** 0.5  # [per element] the sublayers' summed output
        scale = min(1.0, rms(emb) / (margin * max(noise, 1e-30)))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
        if model.lm_head.weight is emb:  # tied: untie first
            model.lm_head.weight = torch.nn.Parameter(emb.detach().clone(), requires_grad=False)
        perm = torch.randperm(emb.shape[0], generator=g, device=emb.device)
        model.lm_head.weight.copy_(emb[perm])
    return model
