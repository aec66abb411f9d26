"""Model shape config (Llama family) and named presets for random init."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int | None = None  # None = hidden_size // num_heads
    max_position: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling / rope_parameters (llama3 supported)
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2-style
    bos_token_id: int | None = 1
    eos_token_ids: list[int] = field(default_factory=lambda: [2])

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, LlamaConfig] = {
    # tests: small enough for CPU CI, GQA on, odd sizes to catch layout bugs
    "tiny": LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_position=2048,
        eos_token_ids=[2],
    ),
    "llama-68m": LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=3072,
        num_layers=2,
        num_heads=12,
        num_kv_heads=12,
        max_position=2048,
    ),
    # SmolLM2-135M's shape (random weights): profiling the real model's step without its GGUF
    "smollm2-135m": LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        max_position=8192,
        rope_theta=100000.0,
        tie_embeddings=True,
        bos_token_id=1,
        eos_token_ids=[2],
    ),
    "llama2-7b": LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        max_position=4096,
    ),
}


def get_preset(name: str) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return LlamaConfig(**PRESETS[name].to_dict())
