"""The transformers-free tokenizer (models/tokenizer_files.py) against transformers' own for the same
files, SmolLM2's and the tiny test tokenizer's: encodings, decodings, the streamed text and rendered
chats are equal; the load-time check (models/tokenizer_check.py) finds each kind of difference; the
loader serves it only after the check, and then without importing transformers."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsched.models import tokenizer_check
from specsched.models.detokenizer import IncrementalDetokenizer
from specsched.models.loader import TOKENIZER_CLASSES_FILE
from specsched.models.tokenizer import Tokenizer, load_tokenizer
from specsched.models.tokenizer_check import differences
from specsched.models.tokenizer_files import FileTokenizer

PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "{{", "}}", "{%", "%}", "\n",
          " ", "  ", "\t", "🚀", "é", "日本", "\u200d", "'", '"', "\\"]  # fmt: skip
TEXT = st.lists(
    st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=12), st.sampled_from(PIECES)),
    max_size=8,
).map("".join)
ROLE = st.sampled_from(["system", "user", "assistant", "tool"])
CHAT = st.lists(st.fixed_dictionaries({"role": ROLE, "content": TEXT}), min_size=1, max_size=5)


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def folder(request) -> Path:
    if request.param == "tiny":
        return request.getfixturevalue("tiny_tokenizer_dir")
    return request.getfixturevalue("smollm2").weights_dir


@pytest.fixture(scope="module")
def pair(folder) -> tuple[FileTokenizer, object]:
    from transformers import AutoTokenizer

    return FileTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def wrapped(pair) -> tuple[Tokenizer, Tokenizer]:
    """The engine's Tokenizer over each (BOS policy, the streaming detokenizer's decode)."""
    return Tokenizer(pair[0]), Tokenizer(pair[1])


def outcome(call, *args, **kwargs):
    try:
        return call(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 -- an error is an output to compare
        return ("raised", type(e).__name__, str(e))


def test_the_check_finds_no_difference(pair):
    assert differences(*pair) is None


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_encoding_equals_transformers(pair, wrapped, text):
    fast, hf = pair
    for add in (True, False):
        assert fast.encode(text, add) == hf.encode(text, add_special_tokens=add)
    assert wrapped[0].encode(text) == wrapped[1].encode(text)  # BOS policy included


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_decoding_and_streamed_text_equal_transformers(pair, wrapped, data):
    fast, hf = pair
    special = sorted(set(hf.all_special_ids) | set(fast.all_special_ids))
    ids = data.draw(st.lists(st.one_of(st.integers(0, len(hf) - 1), st.sampled_from(special)), max_size=24))
    for skip in (True, False):
        want = hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert fast.decode(ids, skip_special_tokens=skip) == want
    chunk = data.draw(st.integers(1, 4))
    streams = []
    for tok in wrapped:
        detok = IncrementalDetokenizer(tok)
        streams.append([detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [detok.flush()])
    assert streams[0] == streams[1]


@settings(max_examples=150, deadline=None)
@given(chat=CHAT, generation_prompt=st.booleans())
def test_rendered_chats_equal_transformers(pair, chat, generation_prompt):
    fast, hf = pair
    for tokenize in (False, True):
        kwargs = dict(add_generation_prompt=generation_prompt, tokenize=tokenize, return_dict=False)
        theirs = outcome(hf.apply_chat_template, chat, **kwargs)
        assert outcome(fast.apply_chat_template, chat, **kwargs) == theirs


def test_the_engines_chat_ids_equal_transformers(wrapped):
    chats = [
        [{"role": "user", "content": "Hi there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 🚀 日本語"}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": ""},
        ],
    ]
    for chat in chats:
        assert wrapped[0].apply_chat_template(chat) == wrapped[1].apply_chat_template(chat)


# ---- the check finds each kind of difference ----------------------------------------------------------


def edited_copy(src: Path, dst: Path, config: dict | None = None, template: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if config:
        path = dst / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if template is not None:
        (dst / "chat_template.jinja").write_text(template)
    return dst


def test_the_check_finds_each_kind_of_difference(tiny_tokenizer_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    def check(folder: Path, **patches) -> str | None:
        fast, hf = FileTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
        for name, value in patches.items():
            monkeypatch.setattr(fast, name, value)
        return differences(fast, hf)

    src = tiny_tokenizer_dir
    assert check(src) is None
    added = edited_copy(src, tmp_path / "added", {"pad_token": "<pad>"})  # transformers adds it to the vocab
    assert check(added) == "transformers changed the Rust tokenizer of tokenizer.json at load"
    split = edited_copy(src, tmp_path / "split", {"split_special_tokens": True})
    assert "splits special tokens" in check(split)
    fast = FileTokenizer(src)
    assert "eos_token_id" in check(src, special_tokens_map={**fast.special_tokens_map, "eos_token": "<unk>"})
    assert "chat_template" in check(src, chat_template=fast.chat_template + " ")
    tokens = fast.encode  # an encoding that differs on one kind of text only
    cut = lambda t, add=True: tokens(t, add)[: -1 if "日" in t else None]  # noqa: E731
    assert "encode('日本語" in check(src, encode=cut)
    assert check(src, decode=lambda ids, skip_special_tokens=False: "").startswith("decode(")
    one_line = fast.chat_template.replace("\n", " ")
    other = FileTokenizer(edited_copy(src, tmp_path / "other", template=one_line))
    assert check(src, _template=other._template).startswith("apply_chat_template(")  # renders otherwise
    hf = AutoTokenizer.from_pretrained(str(src))
    own = type("OwnEncode", (type(hf),), {"encode": lambda self, *a, **kw: type(hf).encode(self, *a, **kw)})
    hf.__class__ = own
    assert differences(fast, hf) == "OwnEncode overrides encode"


def test_files_it_does_not_read_are_refused(tiny_tokenizer_dir, tmp_path):
    named = edited_copy(tiny_tokenizer_dir, tmp_path / "named")
    (named / "chat_template.jinja").unlink()
    config = named / "tokenizer_config.json"
    templates = [{"name": "default", "template": "x"}, {"name": "tool_use", "template": "y"}]
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": templates}))
    with pytest.raises(ValueError, match="several named chat templates"):
        FileTokenizer(named)
    odd = edited_copy(tiny_tokenizer_dir, tmp_path / "odd", {"eos_token": ["</s>"]})
    with pytest.raises(ValueError, match="eos_token is not a string"):
        FileTokenizer(odd)
    plain = edited_copy(tiny_tokenizer_dir, tmp_path / "plain")
    (plain / "chat_template.jinja").unlink()
    assert FileTokenizer(plain).chat_template is None  # no template anywhere: served without chats


# ---- the loader: checked once, remembered, served without transformers --------------------------------


@pytest.fixture
def checks(monkeypatch) -> list:
    """Folders the load-time check ran on from now on."""
    calls: list = []
    real = tokenizer_check.differences

    def counting(fast, hf):
        calls.append(fast.name_or_path)
        return real(fast, hf)

    monkeypatch.setattr(tokenizer_check, "differences", counting)
    return calls


def test_the_loader_serves_it_after_one_check(tiny_tokenizer_dir, tmp_path, checks, caplog):
    folder, memo = edited_copy(tiny_tokenizer_dir, tmp_path / "tok"), tmp_path / TOKENIZER_CLASSES_FILE
    with caplog.at_level(logging.INFO, logger="specsched.models.tokenizer"):
        first = load_tokenizer(folder, memo)
    assert isinstance(first.hf, FileTokenizer) and len(checks) == 1 and "(checked)" in caplog.text
    second = load_tokenizer(folder, memo)
    assert isinstance(second.hf, FileTokenizer) and len(checks) == 1  # the verdict, remembered
    assert second.class_path == first.class_path and second.class_path.startswith("transformers.")
    (folder / "chat_template.jinja").write_text(first.hf.chat_template + "{{ eos_token }}")
    third = load_tokenizer(folder, memo)
    assert isinstance(third.hf, FileTokenizer) and len(checks) == 2  # a changed file: checked again
    chat = [{"role": "user", "content": "hi"}]
    assert third.decode(third.apply_chat_template(chat), skip_special_tokens=False).endswith("</s>")


def test_files_that_differ_are_served_by_transformers(tiny_tokenizer_dir, tmp_path, checks, caplog):
    folder = edited_copy(tiny_tokenizer_dir, tmp_path / "tok", {"pad_token": "<pad>"})
    memo = tmp_path / TOKENIZER_CLASSES_FILE
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specsched.models.tokenizer"):
            tok = load_tokenizer(folder, memo)
        assert not isinstance(tok.hf, FileTokenizer) and tok.vocab_size == len(FileTokenizer(folder)) + 1
        assert "transformers serves (the transformers-free tokenizer differs" in caplog.text  # at each load
    assert len(checks) == 1


def test_a_remembered_tokenizer_that_fails_to_load_falls_back(tiny_tokenizer_dir, tmp_path, monkeypatch,
                                                                 caplog):  # fmt: skip
    folder, memo = edited_copy(tiny_tokenizer_dir, tmp_path / "tok"), tmp_path / TOKENIZER_CLASSES_FILE
    assert isinstance(load_tokenizer(folder, memo).hf, FileTokenizer)

    def broken(self, *args, **kwargs):
        raise ImportError("no tokenizers here")

    monkeypatch.setattr(FileTokenizer, "__init__", broken)
    with caplog.at_level(logging.WARNING):
        tok = load_tokenizer(folder, memo)
    assert not isinstance(tok.hf, FileTokenizer) and tok.encode("hi")[0] == 0
    assert "failed to load (no tokenizers here); transformers serves" in caplog.text


def test_a_warm_load_of_smollm2_does_not_import_transformers(smollm2, smollm2_cache_dir):
    """The session's SmolLM2 was converted and its tokenizer checked: a later process loads the model
    and its tokenizer (and renders a chat) without importing transformers."""
    code = (
        "import sys\n"
        "from specsched.engine.config import ModelConfig\n"
        "from specsched.models.loader import load_model\n"
        f"cfg = ModelConfig(source='smollm2', device='cpu', cache_dir={str(smollm2_cache_dir)!r})\n"
        "tok = load_model(cfg, progress=False).tokenizer\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "print(json.dumps([type(tok.hf).__name__, ids, 'transformers' in sys.modules]))\n"
    )
    code = "import json\n" + code
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    kind, ids, imported = json.loads(out.stdout.splitlines()[-1])
    assert (kind, imported) == ("FileTokenizer", False)
    assert ids == smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- the template environment: what transformers gives a template, on templates that use it ----------

TEMPLATES = {
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + "
        "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
        "<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "alternating": (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
        "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
        "user/assistant/user/assistant/...') }}"
        "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
    ),
    "blocks on their own lines": (
        "{%- for m in messages %}\n"
        "    {%- if m.role == 'system' %}\n"
        "<<SYS>>{{ m.content }}<</SYS>>\n"
        "    {% elif m.role == 'user' %}\n"
        "[INST] {{ m.content | tojson }} [/INST]\n"
        "    {% else %}\n"
        "  {% generation %}\n{{ m.content }}\n  {% endgeneration %}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}\n  [ASSISTANT]\n{% endif %}\n"
    ),
    "globals": (
        "{% set ns = namespace(n=0, last='') %}{% for m in messages %}{% if m.role == 'tool' %}{% continue %}"
        "{% endif %}{% set ns.n = ns.n + 1 %}{% set ns.last = m.role %}{{ ns.n }}:{{ m.content }}|"
        "{% if ns.n > 3 %}{% break %}{% endif %}{% endfor %}{{ dict(a=1, b=ns.last) | tojson(indent=1) }}"
        "{{ dict.fromkeys(['x'], 0) | tojson(sort_keys=true) }}{{ strftime_now('%Y') | length }}"
        "{{ messages | tojson(separators=(',', ':')) }}"
    ),
    "variables": (
        "{% if tools %}T{% endif %}{% if documents is none %}D{% endif %}[{{ messages[0].missing }}]"
        "[{{ eos_token }}][{{ pad_token }}][{{ unk_token }}]{{ messages[0]['content'][:3] | upper }}"
        "{{ messages | map(attribute='role') | join(',') }}{{ messages[-1]['content'].split(' ') | length }}"
    ),
}
ZOO_CHATS = [
    [{"role": "user", "content": "  Hi <b>&amp</b> 'q' \"dq\" "}],
    [{"role": "system", "content": "Grüße 🚀"}, {"role": "user", "content": "日本語\n\nx"}],
    [{"role": r, "content": c} for r, c in [("user", "a"), ("assistant", "b"), ("user", "")]],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],  # breaks the alternation
    [{"role": "tool", "content": "{}"}] + [{"role": "user", "content": str(i)} for i in range(5)],
]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_templates_render_as_in_transformers(name, tiny_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = edited_copy(tiny_tokenizer_dir, tmp_path / "tok", template=TEMPLATES[name])
    fast, hf = FileTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    rendered = []
    for chat in ZOO_CHATS:
        for gen in (False, True):
            kwargs = dict(add_generation_prompt=gen, tokenize=False)
            mine = outcome(fast.apply_chat_template, chat, **kwargs)
            assert mine == outcome(hf.apply_chat_template, chat, **kwargs), (name, chat, gen)
            rendered.append(mine)
    assert any(isinstance(r, str) and r for r in rendered)  # the template rendered something
    assert differences(fast, hf) is None


def test_templates_are_sandboxed(tiny_tokenizer_dir, tmp_path):
    from jinja2.exceptions import SecurityError

    escapes = [
        "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",  # an underscore namespace attribute
        "{% set x = [] %}{{ x.append(1) }}",  # a method that changes a value (immutable sandbox)
        "{{ messages[0].__class__.__mro__ }}",  # the way to Python's internals
    ]
    for i, template in enumerate(escapes):
        fast = FileTokenizer(edited_copy(tiny_tokenizer_dir, tmp_path / str(i), template=template))
        with pytest.raises(SecurityError):
            fast.render_chat([{"role": "user", "content": "hi"}])


def test_truncation_and_padding_in_tokenizer_json_are_off_as_in_transformers(tiny_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = edited_copy(tiny_tokenizer_dir, tmp_path / "tok")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    fast, hf = FileTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    text = "The quick brown fox jumps over the lazy dog."
    assert len(fast.encode(text)) > 4 and fast.encode(text) == hf.encode(text)
    assert differences(fast, hf) is None
    padding = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None}
    spec["padding"] = {**padding, "pad_id": 1, "pad_type_id": 0, "pad_token": "</s>"}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    fast, hf = FileTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert fast.encode(text) == hf.encode(text)  # no padding either
    assert "special_tokens_map" in differences(fast, hf)  # transformers takes a pad token from it
