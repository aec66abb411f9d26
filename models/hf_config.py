"""Map a transformers config (object or ``config.json`` dict) onto our :class:`LlamaConfig`.

Supported: ``llama``, ``mistral`` without an effective sliding window, ``qwen2`` (q/k/v bias, full
attention). RoPE parameters may sit in ``rope_parameters`` (transformers 5) or in top-level
``rope_theta`` + ``rope_scaling`` (transformers 4.x); RoPE types ``default`` and ``llama3``.
Anything the decoder cannot represent raises ValueError naming the feature.
"""

from __future__ import annotations

from typing import Any

from specsched.models.config import LlamaConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _as_dict(hf_config: Any) -> dict:
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"expected a transformers config or a config.json dict, got {type(hf_config).__name__}")


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def llama_config_from_hf(hf_config: Any) -> LlamaConfig:
    """Our decoder's config for an HF checkpoint config; ValueError for what it cannot run."""
    d = _as_dict(hf_config)
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )

    def unsupported(feature: str) -> ValueError:
        return ValueError(
            f"{model_type} checkpoint uses {feature}, which specsched's Llama decoder does not support"
        )

    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        raise ValueError(f"{model_type} config lacks {', '.join(missing)}")
    max_position = int(d.get("max_position_embeddings") or 2048)
    if d.get("hidden_act", "silu") != "silu":
        raise unsupported(f"hidden_act={d['hidden_act']!r} (only silu)")
    if d.get("mlp_bias"):
        raise unsupported("mlp_bias")
    if model_type != "qwen2" and d.get("attention_bias"):
        raise unsupported("attention_bias (an o_proj bias)")
    if d.get("use_sliding_window"):
        raise unsupported("use_sliding_window")
    window = d.get("sliding_window")
    if model_type == "mistral" and window is not None and window < max_position:
        raise unsupported(f"sliding_window={window} (< max_position_embeddings {max_position})")
    layer_types = set(d.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise unsupported(f"layer_types {sorted(layer_types)} (only full_attention)")
    if float(d.get("partial_rotary_factor") or 1.0) != 1.0:
        raise unsupported(f"partial_rotary_factor={d['partial_rotary_factor']}")

    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", d.get("rope_theta") or 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise unsupported(f"rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    scaling = None if rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}

    num_heads = int(d["num_attention_heads"])
    return LlamaConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=int(d["head_dim"]) if d.get("head_dim") else None,
        max_position=max_position,
        rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_id_list(d.get("eos_token_id")),
    )
