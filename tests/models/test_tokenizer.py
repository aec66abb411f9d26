from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specsched.models.detokenizer import IncrementalDetokenizer
from specsched.models.tokenizer import Tokenizer
from specsched.models.tokenizer_files import FileTokenizer

MULTIBYTE = [
    "Grüße aus Köln, naïve café.",
    "日本語のテキストと中文字符。",
    "Rocket 🚀, sparkles ✨ and a family 👨‍👩‍👧 emoji.",
    "  leading spaces, tabs\tand\nnewlines  ",
]


@pytest.fixture(scope="module")
def tiny_tok(tiny_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def any_tok(request, tiny_tok) -> Tokenizer:
    if request.param == "tiny":
        return tiny_tok
    return request.getfixturevalue("smollm2").tokenizer


def stream(tok: Tokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    tail = detok.flush()
    assert detok.text == "".join(pieces) + tail
    return pieces, tail


def test_round_trip(any_tok):
    for text in MULTIBYTE:
        ids = any_tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert any_tok.decode(ids) == text


def test_bos_follows_the_tokenizer(tiny_tok, any_tok):
    # the tiny tokenizer prepends <s> like Llama-2; SmolLM2's does not add any special token
    assert tiny_tok.is_adding_bos and tiny_tok.encode("hi")[0] == tiny_tok.bos_token_id == 0
    assert tiny_tok.encode("hi").count(0) == 1
    plain = any_tok.hf.encode("hi", add_special_tokens=False)
    assert any_tok.encode("hi")[-len(plain) :] == plain
    assert any_tok.eos_token_ids[0] not in any_tok.encode("hi")


def test_smollm2_tokenizer_facts(smollm2):
    tok = smollm2.tokenizer
    assert isinstance(tok.hf, FileTokenizer)  # checked against transformers' at load: serves without it
    assert tok.class_path == "transformers.tokenization_utils_tokenizers:TokenizersBackend"
    assert not tok.is_adding_bos
    assert tok.vocab_size == 49152 and tok.eos_token_ids == [tok.hf._tokenizer.token_to_id("<|im_end|>")]


def test_chat_template_produces_ids(any_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = any_tok.apply_chat_template(msgs)
    assert ids and all(isinstance(i, int) for i in ids)
    text = any_tok.decode(ids, skip_special_tokens=False)
    assert "Be brief." in text and "Hi there" in text
    assert text.rstrip().endswith("assistant")  # the generation prompt opens the assistant turn
    assert any_tok.apply_chat_template(msgs[1:]) != ids


def test_chat_template_errors(tiny_tokenizer_dir):
    tok = Tokenizer.from_pretrained(tiny_tokenizer_dir)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError, match="non-empty list"):
        tok.apply_chat_template([])
    named = {"role": "user", "content": "x", "name": "a"}  # fields besides role and content: FileTokenizer's
    with pytest.raises(ValueError, match=r"messages\[1\] must be a map of exactly"):  # rule for both
        tok.apply_chat_template([{"role": "user", "content": "hi"}, named])
    tok.hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="the chat template refused these messages: roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])  # a client's error, not a jinja2 one
    tok.hf.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_encode_rejects_non_text(tiny_tok):
    with pytest.raises(TypeError, match="expects a str"):
        tiny_tok.encode([1, 2])


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_full_decode(any_tok, chunk):
    for text in MULTIBYTE:
        ids = any_tok.encode(text)
        pieces, tail = stream(any_tok, ids, chunk)
        assert "".join(pieces) + tail == any_tok.decode(ids) == text
        assert tail == ""  # complete text: nothing left held back
        assert not any("\ufffd" in p for p in pieces)


def test_incomplete_utf8_is_held_back(tiny_tok):
    ids = tiny_tok.encode("a🚀")[1:]  # without <s>
    detok = IncrementalDetokenizer(tiny_tok)
    emoji_ids = tiny_tok.encode("🚀")[1:]
    assert len(emoji_ids) > 1, "the tiny BPE must split the emoji into byte tokens for this test"
    out = [detok.push([i]) for i in ids]
    assert out[0] == "a" and all(o == "" for o in out[1:-1]) and out[-1] == "🚀"
    # stopping mid-character: flush hands out the replacement char instead of hiding it
    cut = IncrementalDetokenizer(tiny_tok)
    assert cut.push(emoji_ids[:-1]) == ""
    assert cut.flush() == tiny_tok.decode(emoji_ids[:-1]) and "\ufffd" in cut.text


def test_special_tokens_are_skipped_in_stream(any_tok):
    eos = any_tok.eos_token_ids[0]
    ids = any_tok.encode("done") + [eos]
    pieces, tail = stream(any_tok, ids)
    assert "".join(pieces) + tail == any_tok.decode(ids) == "done"


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=40), chunk=st.integers(1, 4))
def test_incremental_property(tiny_tok, text, chunk):
    ids = tiny_tok.encode(text)
    pieces, tail = stream(tiny_tok, ids, chunk)
    assert "".join(pieces) + tail == tiny_tok.decode(ids)


def test_decode_through_the_rust_backend_equals_the_wrapper(any_tok):
    """Both tokenizers decode through their Rust backend (the streaming path's speed), with the
    wrapper's result on random id sequences, special ids among them, with and without skipping."""
    assert any_tok._backend is not None
    rng = random.Random(0)
    n = len(any_tok.hf)
    special = list(any_tok.hf.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(n) for _ in range(rng.randint(0, 12))] + rng.sample(
            special, k=min(2, len(special))
        )
        rng.shuffle(ids)
        for skip in (True, False):
            assert any_tok.decode(ids, skip_special_tokens=skip) == any_tok._hf_decode(ids, skip)


def test_a_backend_that_decodes_differently_is_not_used(tiny_tok):
    class OwnDecode:  # a wrapper whose decode is its own (as a subclass overriding _decode would be)
        def __init__(self, inner):
            self.inner = inner

        def decode(self, ids, **kw):
            return self.inner.decode(ids, **kw).upper()

        def __len__(self):
            return len(self.inner)

        def __getattr__(self, name):  # everything else, the Rust backend included, as the real one
            return getattr(self.inner, name)

    tok = Tokenizer(OwnDecode(tiny_tok.hf))
    assert tok._backend is None
    ids = tiny_tok.encode("hello world")
    assert tok.decode(ids) == tiny_tok.decode(ids).upper()  # through the wrapper's own decode
