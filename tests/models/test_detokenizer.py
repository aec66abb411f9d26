"""The streaming detokenizer through ``tokenizers``' DecodeStream gives, push by push, the text of its
Python path (the one before DecodeStream): SmolLM2's tokenizer (FileTokenizer and transformers'), the
tiny byte-level BPE, and two SentencePiece-like byte-fallback BPEs (a Strip decoder, a Metaspace one);
random ids, unicode and emoji, byte pieces split across pushes, special tokens with and without
skipping, 1..5 ids per push as speculative steps emit them."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import tokenizers.decoders

from specsched.models.detokenizer import IncrementalDetokenizer
from specsched.models.tokenizer import STREAM_SAMPLES, Tokenizer
from specsched.models.tokenizer_files import FileTokenizer

TEXTS = [
    *STREAM_SAMPLES,
    "Rocket 🚀, sparkles ✨ and a family 👨‍👩‍👧 emoji. 日本語のテキストと中文字符。 Grüße, naïve café.",
    "  leading spaces, tabs\tand\nnewlines  ",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens.",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "Grüße aus Köln! Ça va très bien. 日本語のテキストも少し。 Emoji: 🚀✨",
    "def forward(self, x):\n    return self.proj(x) + x\n",
]


def sentencepiece_like(decoder: str) -> Tokenizer:
    """A Llama-2-like BPE with byte fallback (``<0x00>``..``<0xFF>`` at ids 3..258): ``strip`` decodes
    with Replace + ByteFallback + Fuse + Strip (Llama-2, Mistral), ``metaspace`` with a Metaspace
    decoder (prepend_scheme "first")."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if decoder == "metaspace":
        raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        raw.decoder = decoders.Sequence(
            [
                decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                decoders.ByteFallback(),
                decoders.Fuse(),
            ]
        )
    else:
        raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        raw.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    raw.train_from_iterator(
        CORPUS * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    )
    spec = json.loads(raw.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(spec["vocab"], key=spec["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    out = RawTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    out.normalizer, out.pre_tokenizer, out.decoder = raw.normalizer, raw.pre_tokenizer, raw.decoder
    out.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=out, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer(hf)


@pytest.fixture(scope="module", params=["tiny", "tiny-files", "smollm2", "smollm2-hf", "strip", "metaspace"])
def tok(request, tiny_tokenizer_dir) -> Tokenizer:
    name = request.param
    if name == "tiny":
        return Tokenizer.from_pretrained(tiny_tokenizer_dir)
    if name == "tiny-files":
        return Tokenizer(FileTokenizer(tiny_tokenizer_dir))
    if name.startswith("smollm2"):
        files = request.getfixturevalue("smollm2").tokenizer
        return files if name == "smollm2" else Tokenizer.from_pretrained(Path(files.hf.name_or_path))
    return sentencepiece_like(name)


def streams(tok: Tokenizer, rng: random.Random, num: int) -> list[list[int]]:
    """Encoded texts (cut anywhere: byte pieces split), random ids, and texts with specials and single
    byte-level / byte-fallback ids inserted."""
    n, special = len(tok.hf), list(tok.hf.all_special_ids)
    out = []
    for i in range(num):
        text = rng.choice(TEXTS)
        ids = list(tok.hf.encode(text[rng.randrange(len(text)) :], add_special_tokens=False))
        if i % 3 == 1:
            ids = [rng.randrange(n) for _ in range(rng.randint(1, 40))]
        elif i % 3 == 2:
            for _ in range(3):
                ids.insert(rng.randint(0, len(ids)), rng.choice(special + list(range(min(n, 300)))))
        out.append(ids)
    return out


def both(
    tok: Tokenizer, ids: list[int], rng: random.Random, skip: bool, max_push: int
) -> tuple[list, list, bool]:
    """Pushes (1..max_push ids each), then flush, then pushes after it, through both paths."""
    fast = IncrementalDetokenizer(tok, skip)
    slow = IncrementalDetokenizer(tok, skip, stream=False)
    got, want, i = [], [], 0
    while i < len(ids):
        c = rng.randint(1, max_push)
        got.append(fast.push(ids[i : i + c]))
        want.append(slow.push(ids[i : i + c]))
        i += c
    was_streamed = fast._stream is not None
    got += [fast.flush(), fast.push([]), fast.push(ids[:2]), fast.flush()]
    want += [slow.flush(), slow.push([]), slow.push(ids[:2]), slow.flush()]
    assert fast.text == slow.text == "".join(want)
    return got, want, was_streamed


@pytest.mark.parametrize("skip", [True, False])
def test_streams_equal_the_python_path(tok, skip):
    assert tok.stream_class(skip) is tokenizers.decoders.DecodeStream  # every one here: checked exact
    rng = random.Random(int(skip))
    num_streamed = 0
    for ids in streams(tok, rng, 600):
        got, want, was_streamed = both(tok, ids, rng, skip, rng.choice([1, 1, 2, 3, 5]))
        assert got == want, ids
        num_streamed += was_streamed
    assert num_streamed >= 400  # DecodeStream served most (it raises on some invalid byte-fallback runs)


def test_unicode_split_across_pushes(tok):
    """Every cut of the texts into pushes of one and three ids: complete characters only, in order."""
    for text in TEXTS:
        ids = list(tok.hf.encode(text, add_special_tokens=False))
        for size in (1, 3):
            fast = IncrementalDetokenizer(tok)
            pieces = [fast.push(ids[i : i + size]) for i in range(0, len(ids), size)]
            assert fast._stream is not None and not any("\ufffd" in p for p in pieces)
            assert "".join(pieces) + fast.flush() == tok.decode(ids)


def test_the_stream_path_does_not_decode_in_python(smollm2, monkeypatch):
    tok = smollm2.tokenizer
    ids = tok.encode(TEXTS[2])
    detok = IncrementalDetokenizer(tok)
    monkeypatch.setattr(tok, "decode", lambda *a, **k: pytest.fail("decoded in Python"))
    assert "".join(detok.push([i]) for i in ids) == TEXTS[2]
    monkeypatch.undo()
    assert detok.flush() == ""


def test_a_stream_that_raises_goes_on_in_python(caplog):
    """A byte-fallback tokenizer: 'も' (E3 82 82) and then invalid bytes make DecodeStream raise (its
    window no longer starts with the emitted text); that request goes on in Python with today's text,
    later ones still stream."""
    tok = sentencepiece_like("strip")
    ids = [tok.hf.convert_tokens_to_ids(t) for t in ("<0xE3>", "<0x82>", "<0x82>", "<0xE3>", "a", "b")]
    fast, slow = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok, stream=False)
    with caplog.at_level(logging.DEBUG, logger="specsched.models.detokenizer"):
        got = [fast.push([i]) for i in ids]
    assert fast._stream is None and "DecodeStream failed" in caplog.text
    assert got == [slow.push([i]) for i in ids] and got[2] == "も"
    assert fast.flush() == slow.flush() and fast.text == slow.text
    assert tok.stream_class(True) is not None and IncrementalDetokenizer(tok)._stream is not None


def test_a_decode_stream_that_differs_is_not_used(tiny_tokenizer_dir, monkeypatch, caplog):
    real = tokenizers.decoders.DecodeStream

    class Upper:  # a DecodeStream whose text differs from the Python path's
        def __init__(self, skip_special_tokens: bool) -> None:
            self.inner = real(skip_special_tokens=skip_special_tokens)

        def step(self, backend, ids):
            new = self.inner.step(backend, ids)
            return None if new is None else new.upper()

    monkeypatch.setattr(tokenizers.decoders, "DecodeStream", Upper)
    with caplog.at_level(logging.INFO, logger="specsched.models.tokenizer"):
        tok = Tokenizer.from_pretrained(tiny_tokenizer_dir)
        assert tok.stream_class(True) is None and IncrementalDetokenizer(tok)._stream is None
        IncrementalDetokenizer(tok)
    assert caplog.text.count("streamed text is decoded in Python") == 1  # logged once, at load
    ids = tok.encode("hello world")
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == "hello world"


def test_without_a_rust_backend_the_python_path_serves(tiny_tokenizer_dir):
    tok = Tokenizer.from_pretrained(tiny_tokenizer_dir)
    tok._backend, tok._streams = None, {}
    assert tok.stream_class(True) is None and IncrementalDetokenizer(tok)._stream is None
