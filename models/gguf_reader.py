"""Read a llama-architecture GGUF file straight into a transformers config and an HF state dict.

Why: ``transformers.AutoModelForCausalLM.from_pretrained(gguf_file=...)`` (5.24) parses the file
with ``gguf.GGUFReader`` three times (config, weights, and the config again inside
``AutoTokenizer``; each parse decodes the 49k token strings and 49k merges into numpy views,
~2.5 s) and calls ``gguf.get_tensor_name_map`` once per HF module (397 x ~15 ms); dequantising is
~1 s of it. Converting SmolLM2-135M-Instruct Q4_1 through transformers took 19.5-25.2 s on the
shared 2-core dev box (32 s on the GPU host); with this reader ``convert_gguf`` takes 3.9-5.5 s
(6 runs each, old and new interleaved; the command is in the commit message). The
header is read here in ~50 ms (scalars decoded, arrays skipped over), names are mapped by a fixed
table, and each tensor is dequantised once with ``gguf.quants.dequantize``, the function
transformers calls, so the state dict is bitwise the one transformers builds (tests/models/
test_gguf_reader.py checks that, the config.json and the whole cache entry).

What transformers does and we mirror (``modeling_gguf_pytorch_utils.load_gguf_checkpoint`` with
``LlamaTensorProcessor``): the config keys below, ``tie_word_embeddings`` when the file has no
``output.weight``, the vocabulary size from the token list when ``llama.vocab_size`` is absent,
and the un-permutation of ``attn_q`` / ``attn_k`` rows that llama.cpp's converter applies for its
rotary layout. Anything else -- another architecture, a file transformers would load as
``mistral``, a quant type outside :data:`SUPPORTED_TYPES`, a tensor this table does not know (e.g.
``rope_freqs``, biases) or a missing one, a transformers without ``GgufConfig`` -- raises
:class:`UnsupportedGGUF` naming it, before any tensor is read, so the caller can fall back to the
transformers path.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

ARCHITECTURE = "llama"
# llama.<key> -> transformers LlamaConfig field (as GGUF_CONFIG_MAPPING["llama"] maps them)
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
# llama.cpp's per-block tensor name -> HF module path under model.layers.N
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# ggml types gguf.quants.dequantize turns into float32 (or float16) arrays with numpy
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip


class UnsupportedGGUF(ValueError):
    """A GGUF file this reader does not convert (the message names the architecture, type or tensor)."""


def _hf_name(gguf_name: str, num_layers: int) -> str | None:
    """The HF state-dict key of a llama.cpp tensor name, or None when the table has none."""
    if (m := _BLOCK_NAME.fullmatch(gguf_name)) is not None:
        module = _BLOCK_TENSORS.get(m[2])
        return None if module is None or int(m[1]) >= num_layers else f"model.layers.{m[1]}.{module}.weight"
    stem, _, suffix = gguf_name.rpartition(".")
    module = _GLOBAL_TENSORS.get(stem) if suffix == "weight" else None
    return None if module is None else f"{module}.weight"


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row order: its converter stores each head's rows, viewed as
    [2, head_dim/2] (HF's rotate-half halves), transposed to [head_dim/2, 2] (interleaved pairs)."""
    rows = w.shape[0]  # w: [n_head * head_dim, hidden]
    pairs = w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])  # [n_head, head_dim/2, 2, hidden]
    return pairs.transpose(1, 2).reshape(w.shape)  # [n_head, 2, head_dim/2, hidden] -> [rows, hidden]


# GGUFValueType: the scalars' struct formats (u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64), string, array
_SCALAR_FORMATS = {t: "<" + c for t, c in zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd")}
_STRING, _ARRAY = 8, 9


class _Array(NamedTuple):
    """A metadata array, kept as its length (the token lists are read by the tokenizer, not here)."""

    count: int


class _Tensor(NamedTuple):
    name: str
    qtype: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # uint8 [*rows, bytes per row], a read-only view of the file map


class LlamaGGUF:
    """A llama-architecture GGUF file: :attr:`config_dict` is what transformers' GGUF loader passes
    to ``LlamaConfig``; :meth:`state_dict` dequantises. The header (GGUF v2/v3, little-endian) is
    parsed here in ~50 ms: ``gguf.GGUFReader`` takes ~2.5 s on SmolLM2's file, decoding every token
    string into numpy views, which alone would be half of the whole conversion.

    Raises :class:`UnsupportedGGUF` at construction for anything :meth:`state_dict` could not
    reproduce exactly as transformers does."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.metadata, self._tensors = self._parse()
        except UnsupportedGGUF:
            raise
        except (ValueError, struct.error) as e:
            raise UnsupportedGGUF(f"{self.path.name}: unreadable GGUF header ({e})") from e
        arch = self._value("general.architecture")
        if arch != ARCHITECTURE:
            raise UnsupportedGGUF(f"{self.path.name}: GGUF architecture {arch!r} (this reader: llama only)")
        name = self._value("general.name")
        if name == "mistral":  # transformers loads such a file as a MistralConfig
            raise UnsupportedGGUF(
                f"{self.path.name}: general.name 'mistral' (transformers reads it as mistral)"
            )
        self.config_dict = self._config(name)
        self.num_layers = int(self.config_dict["num_hidden_layers"])
        self.num_heads = int(self.config_dict["num_attention_heads"])
        self.num_kv_heads = int(self.config_dict["num_key_value_heads"])
        self._check_tensors()

    def _parse(self) -> tuple[dict[str, Any], list[_Tensor]]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        mm, unpack = self._map, struct.unpack_from
        if mm[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        version, n_tensors, n_kv = unpack("<IQQ", mm, 4)
        if version not in (2, 3):
            raise ValueError(f"version {version} (v2/v3 little-endian only)")
        pos, metadata = 24, {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            metadata[key], pos = self._read_value(unpack("<I", mm, pos)[0], pos + 4)
        table = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = unpack("<I", mm, pos)
            dims = unpack(f"<{n_dims}Q", mm, pos + 4)  # ggml order: the row length first
            qtype, offset = unpack("<IQ", mm, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            table.append((name, dims, qtype, offset))
        align = int(metadata.get("general.alignment", 32))
        data_start = -(-pos // align) * align
        tensors = []
        for name, dims, qtype, offset in table:
            try:
                qtype = GGMLQuantizationType(qtype)
            except ValueError:
                raise UnsupportedGGUF(
                    f"{self.path.name}: tensor {name} has unknown ggml type {qtype}"
                ) from None
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            shape = (*reversed(dims[1:]), dims[0] // block * block_bytes)  # as gguf.GGUFReader shapes it
            data = np.frombuffer(mm, np.uint8, math.prod(shape), data_start + offset).reshape(shape)
            tensors.append(_Tensor(name, qtype, data))
        return metadata, tensors

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._map, pos)
        return self._map[pos + 8 : pos + 8 + n].decode("utf-8"), pos + 8 + n

    def _read_value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[vtype]
            return struct.unpack_from(fmt, self._map, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(pos)
        if vtype != _ARRAY:
            raise ValueError(f"metadata value type {vtype}")
        etype, count = struct.unpack_from("<IQ", self._map, pos)
        pos += 12
        if etype in _SCALAR_FORMATS:
            return _Array(count), pos + count * struct.calcsize(_SCALAR_FORMATS[etype])
        for _ in range(count):  # strings (or nested arrays, which llama.cpp does not write)
            _, pos = self._read_value(etype, pos)
        return _Array(count), pos

    def _value(self, key: str) -> Any:
        """A scalar metadata value (int / float / bool / str, as transformers parses it), or None."""
        value = self.metadata.get(key)
        if isinstance(value, _Array):
            raise UnsupportedGGUF(f"{self.path.name}: metadata {key} is an array (expected one value)")
        return value

    def _config(self, name: str | None) -> dict[str, Any]:
        names = {t.name for t in self._tensors}
        d: dict[str, Any] = {"model_type": ARCHITECTURE, "tie_word_embeddings": "output.weight" not in names}
        if name is not None:
            d["_model_name_or_path"] = name
        for key, field in [*((f"llama.{k}", v) for k, v in _CONFIG_KEYS.items()), *_TOKEN_ID_KEYS.items()]:
            if (value := self._value(key)) is not None:
                d[field] = value
        if "vocab_size" not in d and isinstance(tokens := self.metadata.get("tokenizer.ggml.tokens"), _Array):
            d["vocab_size"] = tokens.count
        missing = [
            k for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads") if k not in d
        ]
        if missing:  # transformers would leave q/k permuted (no kv count) or guess defaults
            raise UnsupportedGGUF(f"{self.path.name}: metadata lacks {', '.join(missing)}")
        return d

    def _check_tensors(self) -> None:
        """Every tensor known and of a supported type, every HF weight present once."""
        keys = Counter()
        for t in self._tensors:
            if t.qtype.name not in SUPPORTED_TYPES:
                raise UnsupportedGGUF(
                    f"{self.path.name}: tensor {t.name} has ggml type {t.qtype.name} "
                    f"(supported: {', '.join(SUPPORTED_TYPES)})"
                )
            if (key := _hf_name(t.name, self.num_layers)) is None:
                raise UnsupportedGGUF(f"{self.path.name}: tensor {t.name} has no llama HF name here")
            keys[key] += 1
        expected = {
            f"model.layers.{i}.{m}.weight" for i in range(self.num_layers) for m in _BLOCK_TENSORS.values()
        }
        expected |= {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config_dict["tie_word_embeddings"]:
            expected.add("lm_head.weight")
        missing, repeated = sorted(expected - set(keys)), sorted(k for k, n in keys.items() if n > 1)
        if missing or repeated:
            raise UnsupportedGGUF(f"{self.path.name}: tensors missing {missing[:4]}, repeated {repeated[:4]}")

    def __len__(self) -> int:
        return len(self._tensors)

    def state_dict(self, on_tensor: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
        """The HF ``LlamaForCausalLM`` state dict (float32), each tensor dequantised as transformers
        does; with tied embeddings ``lm_head.weight`` is the embedding tensor itself, as in
        ``model.state_dict()``. ``on_tensor(hf_name)`` is called after each tensor (a progress bar)."""
        from gguf.quants import dequantize

        state: dict[str, torch.Tensor] = {}
        for t in self._tensors:
            w = dequantize(t.data, t.qtype)  # [rows, cols] in torch order (1-D for norms)
            if not w.flags.writeable:  # F32 comes back as a view of the read-only file map
                w = np.array(w)
            weight = torch.from_numpy(w).to(torch.float32)
            kind = t.name.split(".")[-2]
            if kind == "attn_q":  # [num_heads * head_dim, hidden]
                weight = _unpermute_rows(weight, self.num_heads)
            elif kind == "attn_k":  # [num_kv_heads * head_dim, hidden]
                weight = _unpermute_rows(weight, self.num_kv_heads)
            name = _hf_name(t.name, self.num_layers)
            assert name is not None  # _check_tensors
            state[name] = weight
            if on_tensor is not None:
                on_tensor(name)
        if self.config_dict["tie_word_embeddings"]:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def hf_config(self) -> Any:
        """The transformers ``LlamaConfig`` that ``from_pretrained(gguf_file=...)`` ends up with
        (float32 dtype, and the ``GgufConfig`` it records as ``quantization_config``). Raises
        :class:`UnsupportedGGUF` under a transformers without ``GgufConfig`` (4.x, whose output
        differs: compared against 5.24 only)."""
        import transformers
        from transformers import LlamaConfig

        GgufConfig = getattr(transformers, "GgufConfig", None)
        if GgufConfig is None:
            raise UnsupportedGGUF(f"transformers {transformers.__version__} has no GgufConfig (< 5)")

        config = LlamaConfig.from_dict(dict(self.config_dict))
        config.dtype = torch.float32
        config.quantization_config = GgufConfig(gguf_file=self.path.name)
        return config
