"""Llama-family decoder over a paged KV cache.

Module and parameter names follow HF ``LlamaForCausalLM`` (``model.layers.N.self_attn.q_proj.weight``
...), so an HF state dict loads with ``load_state_dict``. The forward takes a flat batch of tokens
(no padding) with positions and attention metadata, and returns logits only at the requested
positions. ``num_layers`` runs only the first layers (self-speculative draft: the target's first L
layers + its final norm and head).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specsched.kernels.attention import AttentionFn, get_attention_backend, store_kv
from specsched.kernels.metadata import AttentionMetadata
from specsched.models.config import LlamaConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: ([NB, BS, Hkv, D], [NB, BS, Hkv, D])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D/2]. Rotate-half convention (HF Llama)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,  # [T, D/2]
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        attn: AttentionFn,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        store_kv(k, v, kv[0], kv[1], meta.slot_mapping)
        o = attn(q, kv[0], kv[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv, meta, attn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, attn_backend: str = "torch") -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attn: AttentionFn = get_attention_backend(attn_backend)
        self.attn_backend = attn_backend
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def set_attn_backend(self, name: str) -> None:
        self.attn, self.attn_backend = get_attention_backend(name), name

    def allocate_kv_cache(self, num_blocks: int, block_size: int, num_layers: int | None = None) -> KVCache:
        """Zeroed paged KV cache for ``num_layers`` layers (default all)."""
        p = self.lm_head.weight
        shape = (num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        n = num_layers or self.cfg.num_layers
        return [
            (
                torch.zeros(shape, dtype=p.dtype, device=p.device),
                torch.zeros(shape, dtype=p.dtype, device=p.device),
            )
            for _ in range(n)
        ]

    def kv_bytes_per_block(self, block_size: int, num_layers: int | None = None) -> int:
        n = num_layers or self.cfg.num_layers
        return (
            2
            * n
            * block_size
            * self.cfg.num_kv_heads
            * self.cfg.head_dim
            * self.lm_head.weight.element_size()
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: torch.Tensor | None = None,  # [L] int64; None = every token
        num_layers: int | None = None,  # run only the first num_layers layers (self-draft)
    ) -> torch.Tensor:  # [L, vocab] float32
        n = num_layers or self.cfg.num_layers
        if len(kv_cache) < n:
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, forward needs {n}")
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        x = self.model.embed_tokens(input_ids)
        for layer, kv in zip(self.model.layers[:n], kv_cache[:n]):
            x = layer(x, cos, sin, kv, meta, self.attn)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        return self.lm_head(self.model.norm(x)).float()


def init_random(model: LlamaForCausalLM, seed: int = 0, std: float = 0.02) -> LlamaForCausalLM:
    """Deterministic random init (presets for tests and GPU timing)."""
    dev = model.lm_head.weight.device
    g = torch.Generator(device=dev).manual_seed(seed)  # drawn where the weights live (fast at 7B on GPU)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, device=dev, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * r if "norm" in name else r * std)
    return model


def make_decisive(model: LlamaForCausalLM, seed: int = 0, residual_scale: float = 0.05) -> LlamaForCausalLM:
    """Timing presets only: give random weights decisive greedy choices, so that bf16 rounding in a
    different row layout (batch expansion vs MQA, another k) cannot flip a near-tie and move a request
    off the synthetic proposer's oracle path. The layers' output projections are scaled down (the
    residual stream stays close to the token's embedding) and the LM head's rows are a permutation of
    the embedding rows, so the next token is ``perm^-1(token)`` by a wide margin (|e|^2 against
    cross terms ~|e|^2 / sqrt(hidden)). Compute and bytes moved are unchanged."""
    emb = model.model.embed_tokens.weight
    g = torch.Generator(device=emb.device).manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
        if model.lm_head.weight is emb:  # tied: untie first
            model.lm_head.weight = torch.nn.Parameter(emb.detach().clone(), requires_grad=False)
        perm = torch.randperm(emb.shape[0], generator=g, device=emb.device)
        model.lm_head.weight.copy_(emb[perm])
    return model
