"""Whether a :class:`~specsched.models.tokenizer_files.FileTokenizer` behaves as the transformers
tokenizer of the same files, so that it may serve in its place (models/tokenizer.py remembers the
verdict per file stat and transformers version, and checks again when either changes).

:func:`differences` compares, and names the first difference:

- the class: a transformers fast tokenizer whose encode, decode and chat methods are its base
  class's own (a subclass that overrides one may do anything there);
- the Rust tokenizer transformers built (it may change the file's at load: special tokens added,
  post-processor rebuilt, pre-tokenizer patched) against the file's, as serialised JSON: equal
  models, normalisers, pre-/post-processors and decoders encode and decode alike;
- the facts the engine reads: BOS/EOS ids, vocabulary size, the named special tokens (the chat
  template's variables) and the chat template itself;
- outputs on samples: encodings (with and without special tokens) of texts with whitespace,
  unicode, control characters and special tokens inside; decodings of every id below 2048, the
  special ids and random mixes, skipping special tokens or not; chats (system, user and assistant
  turns, unicode, template syntax and special tokens inside contents, one with an empty content)
  rendered and encoded with and without the generation prompt. An error counts as an output: both
  must raise the same error with the same message.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from specsched.models.tokenizer_files import FileTokenizer

# methods of the transformers tokenizer whose behaviour FileTokenizer reproduces (and what they call)
_CHECKED_METHODS = (
    "__call__", "__len__", "encode", "encode_plus", "_encode_plus", "_batch_encode_plus", "decode",
    "_decode", "apply_chat_template", "get_chat_template", "convert_tokens_to_ids",
    "_convert_token_to_id_with_added_voc",
)  # fmt: skip
_BASES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # transformers 5, 4
TEXTS = [
    "", "a", "Hello world", " leading space", "trailing space ", "  several   spaces  ", "\n", "\n\n\t  \r\n",
    "Grüße aus Köln, naïve café.", "日本語のテキストと中文字符。", "Rocket 🚀, a family 👨‍👩‍👧 and ✨.",
    "e\u0301 (combining), \u200b (zero width), \u00a0 (no-break space)", "عربي עברית", "\x00\x01\ufffd",
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # comment\n", "12345 3.14159 -0 1e10 0x1F", "ALL CAPS, MiXeD",
    "{{ messages }} {% if x %}jinja{% endif %}", "https://example.com/a?b=c&d=%20", "I'm, you're; they'll!",
    "a" * 300, "ab " * 100,
]  # fmt: skip
CONTENTS = ["Hi there", "", "Be brief.", "Grüße 🚀 日本語\n\nnew paragraph  ", "{{ bos_token }} {% raw %}x"]


def _outcome(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """What ``call(*args, **kwargs)`` returns (a BatchEncoding's ids), or its error's type and message."""
    try:
        out = call(*args, **kwargs)
        return out["input_ids"] if hasattr(out, "keys") else out
    except Exception as e:  # noqa: BLE001 -- an error is an output to compare
        return ("raised", type(e).__name__, str(e))


def _class_difference(hf: Any) -> str | None:
    bases = [c for c in type(hf).__mro__ if c.__name__ in _BASES and c.__module__.startswith("transformers.")]
    base = bases[0] if bases else None
    if base is None:
        return f"{type(hf).__qualname__} is not a transformers fast tokenizer"
    for name in _CHECKED_METHODS:
        if hasattr(base, name) and getattr(type(hf), name) is not getattr(base, name):
            return f"{type(hf).__qualname__} overrides {name}"
    return None


def _samples(n: int, special: list[int]) -> list[list[int]]:
    ids = list(range(min(n, 2048)))
    rng = random.Random(0)
    samples = [ids[i : i + 7] for i in range(0, len(ids), 7)] + [special, special + ids[:50], []]
    for _ in range(200):
        mixed = [rng.randrange(n) for _ in range(rng.randint(1, 16))]
        mixed += rng.sample(special, min(2, len(special)))
        rng.shuffle(mixed)
        samples.append(mixed)
    return samples


def _chats(special_text: str) -> list[list[dict]]:
    user = [{"role": "user", "content": c} for c in [*CONTENTS, special_text]]
    system = {"role": "system", "content": "You are terse."}
    answer = {"role": "assistant", "content": "Sure: 42. ✨"}
    chats = [[u] for u in user] + [[system, u] for u in user[:3]]
    chats += [[user[0], answer, user[3]], [system, user[0], answer, user[4]], [system, user[0], answer]]
    return chats + [[answer], [system], [{"role": "tool", "content": '{"result": 1}'}]]


def differences(fast: FileTokenizer, hf: Any) -> str | None:
    """None when ``fast`` behaves as transformers' ``hf`` (loaded from the same files) on everything
    the module's doc lists, else the first difference found."""
    why = _class_difference(hf)
    if why is not None:
        return why
    hf.encode("a")  # a call sets the Rust tokenizer's truncation and padding as every later call does
    theirs, mine = hf._tokenizer.to_str(), fast._tokenizer.to_str()
    if theirs != mine and json.loads(theirs) != json.loads(mine):  # the same text: equal (~0.1 s, not 0.4)
        return "transformers changed the Rust tokenizer of tokenizer.json at load"
    if hf._tokenizer.encode_special_tokens != fast._tokenizer.encode_special_tokens:
        return "transformers splits special tokens in text (split_special_tokens)"
    facts = ("bos_token_id", "eos_token_id", "special_tokens_map", "chat_template")
    for name in facts:
        if getattr(hf, name) != getattr(fast, name):
            return f"{name}: {getattr(fast, name)!r} here, {getattr(hf, name)!r} in transformers"
    if len(hf) != len(fast):
        return f"vocabulary size: {len(fast)} here, {len(hf)} in transformers"
    special = fast.all_special_ids
    special_text = "a" + "b".join(fast._tokenizer.id_to_token(i) for i in special[:8]) + "c"
    for text in [*TEXTS, special_text]:
        for add in (True, False):
            if _outcome(fast.encode, text, add) != _outcome(hf.encode, text, add_special_tokens=add):
                return f"encode({text!r}, add_special_tokens={add})"
    for ids in _samples(len(fast), special):
        for skip in (True, False):
            mine = _outcome(fast.decode, ids, skip_special_tokens=skip)
            if mine != _outcome(hf.decode, ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False):
                return f"decode({ids}, skip_special_tokens={skip})"
    if fast.chat_template is None:
        return None
    for chat in _chats(special_text):
        for gen in (True, False):
            for tokenize in (False, True):
                kwargs = dict(add_generation_prompt=gen, tokenize=tokenize, return_dict=False)
                if _outcome(fast.apply_chat_template, chat, **kwargs) != _outcome(
                    hf.apply_chat_template, chat, **kwargs
                ):
                    return f"apply_chat_template({chat}, add_generation_prompt={gen}, tokenize={tokenize})"
    return None
