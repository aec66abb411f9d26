"""Llama-family decoder over a paged KV cache.

Module and parameter names follow HF ``LlamaForCausalLM`` (``model.layers.N.self_attn.q_proj.weight``
...), so an HF state dict loads with ``load_state_dict``. The forward takes a flat batch of tokens
(no padding) with positions and attention metadata, and returns logits only at the requested
positions. ``num_layers`` runs only the first layers (self-speculative draft: the target's first L
layers + its final norm and head).

Deterministic mode (``deterministic=True``, ``model.deterministic``): a token's logits are a function
of its own context alone, bit for bit, not of the batch, the scorer, k or the other requests. Every
linear layer (and the LM head) runs the batch-invariant matmul
(:mod:`specsched.kernels.batch_invariant_matmul`) and attention its deterministic variant
(:mod:`specsched.kernels.batch_invariant_attention`). The other ops already are row-wise: the
embedding gather, RoPE's cos/sin (elementwise) and the rotary + KV-store kernel (one program per
token), RMSNorm (one program, or one torch row reduction, per token), SiLU-mul (elementwise), the
row gather of ``logits_indices``. The default path is untouched.

Fused linear layers (``fused_linear=True``, ``model.fused_linear``): forwards of at most
:data:`~specsched.kernels.fused_linear.FUSED_MAX_ROWS` token rows on CUDA (decode and verify steps)
run each layer's residual add + RMSNorm inside the QKV and gate/up GEMMs, SiLU-mul in the gate/up
GEMM's epilogue, and the final norm inside the LM head (:mod:`specsched.kernels.fused_linear`): three
launches per layer fewer than the default path (two norms, SiLU-mul), and none of the split-K
reduction kernels cuBLAS adds to those GEMMs at small M (the down projection stays cuBLAS's). Same
rounding points; only the GEMMs' fp32 accumulation order differs. With ``fused_linear_gemms`` the
output and down projections run the same family's plain small-M kernel too (no split-K second
launch; :mod:`specsched.kernels.small_linear`). Larger forwards, and every forward off CUDA, take the
default path (under ``TRITON_INTERPRET=1`` the fused kernels run on the CPU, for tests). Not with
``deterministic``: the fused kernels are row-invariant, but forwards above 16 rows are not fused, so
a token's logits would depend on its batch's size again. Parameters and their names are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from specsched.kernels.activation import silu_and_mul
from specsched.kernels.attention import AttentionFn, get_attention_backend
from specsched.kernels.batch_invariant_attention import deterministic_attention_backend
from specsched.kernels.fused_linear import FUSED_MAX_ROWS, norm_linear, norm_swiglu
from specsched.kernels.metadata import AttentionMetadata
from specsched.kernels.rotary import rotary_store_kv
from specsched.kernels.triton_utils import is_interpreted
from specsched.models.config import LlamaConfig
from specsched.models.hf_names import fuse_on_load
from specsched.models.layers import Linear, RMSNorm, rope_inv_freq

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: ([NB, BS, Hkv, D], [NB, BS, Hkv, D])


class LlamaAttention(nn.Module):
    """Self-attention with one fused QKV projection; output rows are ``[q heads | k heads | v heads]``.
    HF's ``q_proj``/``k_proj``/``v_proj`` weights are concatenated into ``qkv_proj`` on load."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h = cfg.hidden_size
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, h, bias=False)
        self.scale = self.head_dim**-0.5
        self._register_load_state_dict_pre_hook(
            lambda state, prefix, *_: fuse_on_load(
                state, prefix, "qkv_proj", ("q_proj", "k_proj", "v_proj"), ("weight", "bias")
            )
        )

    def forward_from_qkv(
        self,
        qkv: torch.Tensor,  # [T, q_size + 2 * kv_size]: qkv_proj's output (fused with the norm)
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,  # [T, D/2]
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        attn: AttentionFn,
    ) -> torch.Tensor:  # [T, hidden]
        """Attention after the QKV projection (the fused path, :meth:`LlamaDecoderLayer.forward_fused`;
        the default path is :meth:`LlamaDecoderLayer.pre_attention` / ``post_attention``)."""
        q = rotary_store_kv(qkv, cos, sin, kv[0], kv[1], meta.slot_mapping, self.num_heads, self.num_kv_heads)
        o = attn(q, kv[0], kv[1], meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(qkv.shape[0], self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU with one fused gate/up projection (HF's ``gate_proj``/``up_proj`` concatenated on load)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self._register_load_state_dict_pre_hook(
            lambda state, prefix, *_: fuse_on_load(
                state, prefix, "gate_up_proj", ("gate_proj", "up_proj"), ("weight",)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer. The residual stream travels beside the layer output: each layer's
    output is added to it inside the next norm (``add_rms_norm``), one kernel instead of two."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's output (the embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the residual stream before x is added; None at layer 0
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        attn: AttentionFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (layer output, residual stream) — their sum is the hidden state
        q, residual = self.pre_attention(x, residual, cos, sin, kv, meta.slot_mapping)
        return self.post_attention(attn(q, kv[0], kv[1], meta, self.self_attn.scale), residual)

    def pre_attention(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's output (the embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]; None at layer 0 (x is then the residual)
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,  # [T, D/2]
        kv: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,  # [T] int64: where each token's K/V is stored
        *,
        q_out: torch.Tensor | None = None,  # [T, heads, D]: write the rotated q here
        residual_out: torch.Tensor | None = None,  # [T, hidden]: write the new residual here (layer > 0)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (rotated q [T, heads, D], residual stream [T, hidden])
        """The layer up to its attention: input norm (+ residual add), QKV projection, RoPE and the
        K/V store. :meth:`forward` is this, the attention, then :meth:`post_attention`; the
        piecewise graphs (models/piecewise_graphs.py) capture the two parts and launch the attention
        between them."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual, residual_out=residual_out)
        sa = self.self_attn
        qkv = sa.qkv_proj(h)
        heads = (sa.num_heads, sa.num_kv_heads)
        return rotary_store_kv(qkv, cos, sin, kv[0], kv[1], slot_mapping, *heads, q_out=q_out), residual

    def post_attention(
        self,
        o: torch.Tensor,  # [T, heads, D]: the attention's output
        residual: torch.Tensor,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (layer output, residual stream), as forward
        """The layer after its attention: output projection, post-attention norm (+ residual add), MLP."""
        h = self.self_attn.o_proj(o.reshape(o.shape[0], self.self_attn.q_size))
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, hidden], T <= FUSED_MAX_ROWS
        residual: torch.Tensor | None,  # [T, hidden]; None at layer 0
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        attn: AttentionFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # as forward
        """:meth:`forward` with the norms and SiLU-mul fused into the QKV and gate/up GEMMs (the module
        docstring)."""
        ln1, ln2, sa, mlp = self.input_layernorm, self.post_attention_layernorm, self.self_attn, self.mlp
        qkv, residual = norm_linear(x, residual, ln1.weight, ln1.eps, sa.qkv_proj.weight, sa.qkv_proj.bias)
        h = sa.forward_from_qkv(qkv, cos, sin, kv, meta, attn)
        act, residual = norm_swiglu(h, residual, ln2.weight, ln2.eps, mlp.gate_up_proj.weight)
        return mlp.down_proj(act), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        attn_backend: str = "torch",
        deterministic: bool = False,
        fused_linear: bool = False,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attn: AttentionFn = get_attention_backend(attn_backend)
        self.attn_backend = attn_backend
        self.deterministic = False
        self.fused_linear = False
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if deterministic:
            self.set_deterministic(True)
        if fused_linear:
            self.set_fused_linear(True)

    def set_attn_backend(self, name: str) -> None:
        if self.deterministic and name != self.attn_backend:
            # eager forwards and captured graphs must run one attention: the paths differ bitwise
            raise ValueError(
                f"deterministic mode keeps attention backend {self.attn_backend!r}; cannot switch to "
                f"{name!r} (on CUDA use triton for the model and its graphs)"
            )
        self.attn, self.attn_backend = get_attention_backend(name), name
        if self.deterministic:
            self.attn = deterministic_attention_backend(name)

    def set_deterministic(self, on: bool) -> None:
        """Deterministic mode on or off (module docstring): every linear layer and the attention."""
        if on and self.fused_linear:
            raise ValueError("deterministic mode cannot run with fused_linear (not batch-invariant)")
        if on:
            self.attn = deterministic_attention_backend(self.attn_backend)  # raises for flash_attn
        else:
            self.attn = get_attention_backend(self.attn_backend)
        for m in self.modules():
            if isinstance(m, Linear):
                m.deterministic = on
        self.deterministic = on

    def set_fused_linear(self, on: bool, gemms: bool = False) -> None:
        """The fused small-M linear layers on or off (module docstring); ``gemms``: with them, the
        attention output and down projections in the small-M kernel too."""
        if on and self.deterministic:
            raise ValueError("fused_linear cannot run with deterministic mode (not batch-invariant)")
        if gemms and not on:
            raise ValueError("the small-M output / down projections need fused_linear on")
        self.fused_linear = on
        for layer in self.model.layers:
            layer.self_attn.o_proj.is_small_m = layer.mlp.down_proj.is_small_m = gemms

    def uses_fused_linear(self, x: torch.Tensor) -> bool:
        """Whether a forward over rows ``x`` [T, hidden] takes the fused path."""
        return self.fused_linear and x.shape[0] <= FUSED_MAX_ROWS and (x.is_cuda or is_interpreted())

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
        x, residual = self.model.embed_tokens(input_ids), None
        if self.fused_linear and self.uses_fused_linear(x):
            for layer, kv in zip(self.model.layers[:n], kv_cache[:n]):
                x, residual = layer.forward_fused(x, residual, cos, sin, kv, meta, self.attn)
        else:
            for layer, kv in zip(self.model.layers[:n], kv_cache[:n]):
                x, residual = layer(x, residual, cos, sin, kv, meta, self.attn)
        if logits_indices is not None:
            x, residual = x.index_select(0, logits_indices), residual.index_select(0, logits_indices)
        if self.fused_linear and self.uses_fused_linear(x):
            norm, head = self.model.norm, self.lm_head
            return norm_linear(x, residual, norm.weight, norm.eps, head.weight, head.bias)[0].float()
        return self.lm_head(self.model.norm.add_and_norm(x, residual)[0]).float()
