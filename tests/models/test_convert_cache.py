"""The start-up's small caches: the conversion cache's sha256 memo (``digests.json``), the tokenizer
class AutoTokenizer picked (``tokenizer_classes.json``), and the conversion cache's outcome on the
loaded model. Each: a second load hits, a changed file misses, a damaged memo is warned about and
rewritten, never a crash."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from specsched.engine.config import ModelConfig
from specsched.models import convert, tokenizer
from specsched.models.convert import DIGESTS_FILE, StatMemo, file_sha256, sources_digest
from specsched.models.loader import TOKENIZER_CLASSES_FILE, load_model
from specsched.models.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture
def hashes(monkeypatch) -> list:
    """The source lists hashed (file_sha256 calls) from now on."""
    calls: list = []

    def counting(paths):
        calls.append(list(paths))
        return file_sha256(paths)

    monkeypatch.setattr(convert, "file_sha256", counting)
    return calls


def test_stat_memo_answers_only_for_the_same_stat(tmp_path, caplog):
    memo = StatMemo(tmp_path / "m.json", "test cache")
    assert memo.get("k", [1, 2]) is None  # no file yet
    memo.put("k", [1, 2], "v")
    memo.put("other", [3], "w")
    assert memo.get("k", [1, 2]) == "v" and memo.get("k", [1, 3]) is None and memo.get("other", [3]) == "w"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]  # no temporary file left
    for damage in ("{not json", '["a list"]', '{"k": "not an entry"}'):
        (tmp_path / "m.json").write_text(damage)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert memo.get("k", [1, 2]) is None
        assert "test cache: ignoring" in caplog.text and "rewriting it" in caplog.text
        memo.put("k", [1, 2], "v2")
        assert memo.get("k", [1, 2]) == "v2"
    ro = StatMemo(tmp_path / "file" / "m.json", "test cache")  # a parent that is a file: cannot write
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.WARNING):
        ro.put("k", [1], "v")  # warned, not raised
    assert "cannot write" in caplog.text and ro.get("k", [1]) is None


def test_digest_is_remembered_until_the_source_changes(tmp_path, hashes, caplog):
    src, cache = tmp_path / "model.gguf", tmp_path / "cache"
    src.write_bytes(b"weights " * 1000)
    first = sources_digest([src], cache)
    assert first == file_sha256([src]) and len(hashes) == 1
    assert sources_digest([src], cache) == first and len(hashes) == 1  # the memo answers: no byte read
    src.write_bytes(b"other weights " * 1000)  # changed (size, mtime, ctime)
    changed = sources_digest([src], cache)
    assert changed == file_sha256([src]) != first and len(hashes) == 2
    data = src.read_bytes()
    stat = src.stat()
    src.write_bytes(data[::-1])  # same size, mtime put back by hand: the ctime still moves
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert sources_digest([src], cache) == file_sha256([src]) != changed and len(hashes) == 3
    (cache / DIGESTS_FILE).write_text('{"truncated": ')
    with caplog.at_level(logging.WARNING):
        assert sources_digest([src], cache) == file_sha256([src]) and len(hashes) == 4
    assert "ignoring the damaged" in caplog.text
    json.loads((cache / DIGESTS_FILE).read_text())  # rewritten whole
    assert sources_digest([src], cache) and len(hashes) == 4


def test_bin_conversion_reports_built_then_hit_and_hashes_once(tmp_path, tiny_hf_dir, hashes):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "bin-model"
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32)
    hf.save_pretrained(str(src))
    (src / "model.safetensors").unlink()
    torch.save({k: v.clone() for k, v in hf.state_dict().items()}, src / "pytorch_model.bin")
    for f in tiny_hf_dir.iterdir():
        if f.suffix == ".json" and f.name != "config.json" or f.suffix == ".jinja":
            shutil.copy2(f, src / f.name)
    cfg = ModelConfig(source=str(src), device="cpu", cache_dir=str(tmp_path / "cache"))
    first = load_model(cfg)
    assert first.conversion == "built" and len(hashes) == 1
    second = load_model(cfg)
    assert second.conversion == "hit" and second.weights_dir == first.weights_dir and len(hashes) == 1
    in_place = ModelConfig(source=str(tiny_hf_dir), device="cpu")
    assert load_model(in_place).conversion == "none" and load_model(in_place).tokenizer is not None
    assert load_model(in_place, with_tokenizer=False).tokenizer is None  # a draft model: weights only
    assert load_model(ModelConfig(source="tiny", device="cpu")).conversion == "none"


def test_model_building_does_not_import_dynamo():
    """Parameters are made on meta without nn.init: ``with torch.device("meta")`` runs ops through
    torch._refs, whose first call imports torch._dynamo (~2 s of every start)."""
    code = (
        "import sys\n"
        "from specsched.engine.config import ModelConfig\n"
        "from specsched.models.loader import load_model\n"
        "m = load_model(ModelConfig(source='tiny', device='cpu', dtype='bfloat16')).model\n"
        "assert all(p.device.type == 'cpu' for p in m.parameters())\n"
        "assert m.inv_freq.dtype.is_floating_point and m.inv_freq.dtype != m.lm_head.weight.dtype\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


# ---- the tokenizer class ------------------------------------------------------------------------------


@pytest.fixture
def auto_loads(monkeypatch) -> list:
    """Paths AutoTokenizer loaded from now on."""
    from transformers import AutoTokenizer

    calls: list = []
    real = AutoTokenizer.from_pretrained.__func__

    def counting(cls, path, *a, **kw):
        calls.append(path)
        return real(cls, path, *a, **kw)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counting))
    return calls


def test_tokenizer_class_is_remembered_until_a_file_changes(tmp_path, tiny_tokenizer_dir, auto_loads, caplog):
    folder, memo = tmp_path / "tok", tmp_path / "cache" / TOKENIZER_CLASSES_FILE
    shutil.copytree(tiny_tokenizer_dir, folder)
    first = load_tokenizer(folder, memo)
    assert len(auto_loads) == 1 and first.class_path.startswith("transformers.")
    second = load_tokenizer(folder, memo)
    assert len(auto_loads) == 1 and second.class_path == first.class_path  # the class, directly
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    load_tokenizer(folder, memo)
    assert len(auto_loads) == 2  # a changed file: AutoTokenizer picks again
    (folder / "notes.txt").write_text("a new file counts too")
    load_tokenizer(folder, memo)
    assert len(auto_loads) == 3
    load_tokenizer(folder, memo)
    assert len(auto_loads) == 3
    memo.write_text("\x00garbage")
    with caplog.at_level(logging.WARNING):
        load_tokenizer(folder, memo)
    assert len(auto_loads) == 4 and "tokenizer class cache: ignoring the damaged" in caplog.text
    load_tokenizer(folder, memo)
    assert len(auto_loads) == 4


def test_a_remembered_class_that_is_gone_falls_back_to_auto(tmp_path, tiny_tokenizer_dir, auto_loads):
    for bad in ("transformers.nowhere:Tokenizer", "os:path", "transformers.tokenization_utils_base:nope"):
        assert tokenizer._transformers_class(bad) is None
        tok = Tokenizer.from_pretrained(tiny_tokenizer_dir, tokenizer_class=bad)
        assert tok.encode("hi") and auto_loads[-1] == str(tiny_tokenizer_dir)
    assert len(auto_loads) == 3


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_the_remembered_class_loads_what_auto_tokenizer_loads(which, request, tmp_path):
    folder = (
        request.getfixturevalue("smollm2").weights_dir
        if which == "smollm2"
        else request.getfixturevalue("tiny_hf_dir")
    )
    auto = Tokenizer.from_pretrained(folder)
    direct = Tokenizer.from_pretrained(folder, tokenizer_class=auto.class_path)
    assert type(direct.hf) is type(auto.hf)
    assert (direct.eos_token_ids, direct.bos_token_id, direct.is_adding_bos, direct.vocab_size) == (
        auto.eos_token_ids,
        auto.bos_token_id,
        auto.is_adding_bos,
        auto.vocab_size,
    )
    assert direct.hf.special_tokens_map == auto.hf.special_tokens_map
    assert direct.hf.chat_template == auto.hf.chat_template
    texts = ["Hello world", " leading space", "Grüße, 日本語 🚀", "a<|im_end|>b</s>c", "\n\n  x"]
    for text in texts:
        assert direct.encode(text) == auto.encode(text), text
        ids = auto.encode(text)
        assert direct.decode(ids) == auto.decode(ids)
        assert direct.decode(ids, skip_special_tokens=False) == auto.decode(ids, skip_special_tokens=False)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": texts[3]}]
    assert direct.apply_chat_template(chat) == auto.apply_chat_template(chat)
