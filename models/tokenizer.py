"""Tokenizer wrapper over a transformers tokenizer (the streaming detokenizer: models/detokenizer.py).

BOS policy: ``encode`` adds a BOS token exactly when the tokenizer itself would (its own
``add_special_tokens=True`` output starts with ``bos_token_id`` while the plain encoding does not;
e.g. Llama-2 adds ``<s>``, SmolLM2 and Qwen2 add nothing). Nothing else is ever added (no EOS).
Chat templates render their own special tokens, so ``apply_chat_template`` adds none.

Decoding skips special tokens (``<|im_end|>``, ``</s>``...) and never "cleans up" spaces, so the
streamed text of :class:`~specsched.models.detokenizer.IncrementalDetokenizer` concatenates to
exactly ``decode(all ids)``.

Loading (:func:`load_tokenizer`): importing transformers alone takes ~2 s of a start, so a folder
whose files were found to tokenize, decode and render chats exactly as transformers' tokenizer does
(:mod:`~specsched.models.tokenizer_check`, on the first load of these files under this transformers
version) is served by a :class:`~specsched.models.tokenizer_files.FileTokenizer` (``tokenizers`` and
jinja2; no transformers import) on every later load; files that differ in anything checked are
served by transformers (logged at each load). Either way the verdict and the class ``AutoTokenizer``
picked are remembered in a JSON file under the files' stat: AutoTokenizer's pick imports
transformers' model configs (torch.distributed, sympy: ~2 s more), while that class's own
``from_pretrained`` (what AutoTokenizer calls) loads the files directly.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from specsched.models.convert import StatMemo, file_stat
from specsched.models.detokenizer import IncrementalDetokenizer
from specsched.models.tokenizer_files import FileTokenizer

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")  # files that do not pick the class
SAME_AS_TRANSFORMERS = "same"  # the remembered verdict that lets a FileTokenizer serve
logger = logging.getLogger(__name__)


class Tokenizer:
    """Text <-> token ids for one model.

    ``eos_token_ids``: the tokenizer's EOS followed by any extra ids (the model config's EOS list),
    without duplicates. ``vocab_size`` is the tokenizer's (``len(tokenizer)``, added tokens
    included); the model's embedding table may be larger (padded).
    """

    def __init__(self, hf_tokenizer: Any, extra_eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos: list[int] = []
        for i in [hf_tokenizer.eos_token_id, *extra_eos_token_ids]:
            if i is not None and int(i) not in eos:
                eos.append(int(i))
        self.eos_token_ids: list[int] = eos
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.is_adding_bos: bool = _tokenizer_adds_bos(hf_tokenizer)
        # the Rust tokenizer, where it decodes the same (a FileTokenizer decodes through it anyway)
        is_files = isinstance(hf_tokenizer, FileTokenizer)
        self._backend = hf_tokenizer._tokenizer if is_files else _checked_backend(hf_tokenizer)
        self._streams: dict[bool, Any | None] = {}  # skip_special_tokens -> the DecodeStream class or None
        self.stream_class(skip_special_tokens=True)  # checked at load (the daemon streams with skipping)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        gguf_file: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        tokenizer_class: str | None = None,
    ) -> Tokenizer:
        """Load from a local folder (``tokenizer.json`` etc.), or from a GGUF file in it.
        ``tokenizer_class``: the :attr:`class_path` AutoTokenizer picked for these files before (with
        this transformers version): loaded with it directly; None or an unknown class: AutoTokenizer."""
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        hf_class = _transformers_class(tokenizer_class) if tokenizer_class and not gguf_file else None
        if hf_class is None:
            from transformers import AutoTokenizer

            hf_class = AutoTokenizer
        hf = hf_class.from_pretrained(str(path), local_files_only=True, **kwargs)
        return cls(hf, extra_eos_token_ids)

    @property
    def class_path(self) -> str:
        """``module:Class`` of the transformers tokenizer (``tokenizer_class`` of a later load); for a
        FileTokenizer, the transformers class it was checked against."""
        own = f"{type(self.hf).__module__}:{type(self.hf).__qualname__}"
        return getattr(self.hf, "class_path", None) or own

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def name(self) -> str:
        return str(getattr(self.hf, "name_or_path", "") or type(self.hf).__name__)

    @property
    def is_thread_safe(self) -> bool:
        """Whether :meth:`encode` and :meth:`apply_chat_template` may run on one thread while another
        decodes: a :class:`FileTokenizer` calls the Rust tokenizer's read-only methods and a compiled
        template; a transformers tokenizer may reconfigure its Rust tokenizer (truncation, padding)
        inside an encode, which then fails beside a decode ("Already borrowed")."""
        return isinstance(self.hf, FileTokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; a BOS first only when the tokenizer adds one (see module doc)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if self.is_adding_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if self._backend is not None:  # ~1 us instead of ~4 (the streaming detokenizer: 2 per step)
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._hf_decode(ids, skip_special_tokens)

    def stream_class(self, skip_special_tokens: bool) -> Any | None:
        """``tokenizers.decoders.DecodeStream`` when streaming through it over the Rust backend gives
        what :class:`~specsched.models.detokenizer.IncrementalDetokenizer`'s own path gives
        (:func:`_checked_stream`, checked once per tokenizer and ``skip_special_tokens``); else None
        (a difference is logged once)."""
        if skip_special_tokens not in self._streams:
            self._streams[skip_special_tokens] = None  # while checking: the detokenizer's own path
            found, why = _checked_stream(self, skip_special_tokens)
            if why is not None:
                logger.info("tokenizer %s: streamed text is decoded in Python (skip_special_tokens=%s): %s",
                            self.name, skip_special_tokens, why)  # fmt: skip
            self._streams[skip_special_tokens] = found
        return self._streams[skip_special_tokens]

    def _hf_decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Render a chat ``[{"role": ..., "content": ...}]`` with the model's template, followed by
        the assistant turn's opening (``add_generation_prompt=True``), as token ids."""
        if not self.has_chat_template:
            raise ValueError(
                f"tokenizer {self.name!r} has no chat template; send a raw 'prompt' or 'prompt_ids' instead"
            )
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} maps")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or set(m) != {"role", "content"}
                or not isinstance(m["role"], str)
                or not isinstance(m["content"], str)
            ):
                raise ValueError(f"messages[{i}] must be a map of exactly str 'role' and 'content': {m!r}")
        try:
            ids = self.hf.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as e:
            if type(e).__module__.startswith("jinja2."):  # e.g. raise_exception(...): the chat's fault
                raise ValueError(f"the chat template refused these messages: {e}") from None
            raise
        if hasattr(ids, "keys"):  # BatchEncoding from a transformers that ignores return_dict
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def save_pretrained(self, path: str | Path) -> None:
        self.hf.save_pretrained(str(path))


def _checked_backend(hf: Any) -> Any | None:
    """``hf``'s Rust ``tokenizers.Tokenizer`` when decoding through it gives what ``hf.decode`` gives
    (without the clean-up, which we never use) on a sample: every id below 2048, the special ids,
    and a few mixed sequences, with and without special tokens; else None (``hf.decode`` is used)."""
    backend = getattr(hf, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    try:
        n = len(hf)
        special = [int(i) for i in getattr(hf, "all_special_ids", []) if 0 <= int(i) < n]
        ids = list(range(min(n, 2048)))
        samples = [ids[i : i + 7] for i in range(0, len(ids), 7)] + [special, special + ids[:50]]
        samples += [ids[::37], ids[1::11][:64]]
        for sample in samples:
            for skip in (True, False):
                want = hf.decode(sample, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
                if backend.decode(sample, skip_special_tokens=skip) != want:
                    return None
    except Exception:  # noqa: BLE001 -- any doubt: the wrapper's decode
        return None
    return backend


# streamed in the check of DecodeStream: multi-byte UTF-8 (accents, CJK, emoji with modifiers and ZWJ
# sequences, combining marks, flags), leading and repeated spaces, tabs and newlines
STREAM_SAMPLES = (
    "  Grüße aus Köln, naïve café. 日本語のテキストと中文字符。\n\tRocket 🚀, sparkles ✨, a family 👨‍👩‍👧,"
    " 👍🏽 e\u0301 🇩🇪 ½ — “quotes” ...   spaces\n\n",
    "def f(x):\n    return x  # ok\r\n\u00a0\u200b\U0001f9ea end",
)


def _checked_stream(tok: Tokenizer, skip_special_tokens: bool) -> tuple[Any | None, str | None]:
    """(``DecodeStream``, None) when :class:`IncrementalDetokenizer` through it gives, push by push,
    what its Python path gives on sample streams, flushes and pushes after a flush included; else
    (None, why not). The samples: every id below 2048 (byte and byte-fallback tokens among them) and
    seeded random ids of the whole vocabulary with the special ids mixed in, pushed 1..5 at a time
    (speculative steps emit several), and the encoded :data:`STREAM_SAMPLES` pushed 1, 2 and 3 at a
    time: ~10 ms."""
    if tok._backend is None:
        return None, "no Rust tokenizer decodes as this tokenizer does"
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None, "this tokenizers package has no DecodeStream (0.21 and later have it)"
    try:
        n = len(tok.hf)
        rng = random.Random(0)
        special = sorted({int(i) for i in getattr(tok.hf, "all_special_ids", []) if 0 <= int(i) < n})
        streams = []
        for text in STREAM_SAMPLES:
            ids = list(tok.hf.encode(text, add_special_tokens=False))
            streams += [[ids[i : i + c] for i in range(0, len(ids), c)] for c in (1, 2, 3)]
        ids = list(range(min(n, 2048)))
        for _ in range(24):
            ids += [rng.randrange(n) for _ in range(rng.randint(1, 40))]
            ids += rng.sample(special, min(2, len(special)))
        chunks = []
        while ids:
            chunks.append(ids[: rng.randint(1, 5)])
            del ids[: len(chunks[-1])]
        streams += [chunks[i : i + 25] for i in range(0, len(chunks), 25)]  # a request per 25 pushes
        for pushes in streams:
            ref = IncrementalDetokenizer(tok, skip_special_tokens, stream=False)
            fast = IncrementalDetokenizer(tok, skip_special_tokens, stream=False)
            fast._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for chunk in pushes:  # a push that makes DecodeStream raise continues in Python: checked too
                want, got = ref.push(chunk), fast.push(chunk)
                if got != want:
                    return None, f"ids {chunk} streamed {got!r} instead of {want!r}"
            for _ in range(2):
                want, got = ref.flush() + ref.push([]), fast.flush() + fast.push([])
                if got != want or fast.text != ref.text:
                    return None, f"the flush gave {got!r} instead of {want!r}"
    except Exception as e:  # noqa: BLE001 -- any doubt: the Python path
        return None, f"{type(e).__name__}: {e}"[:400]
    return DecodeStream, None


def load_tokenizer(folder: Path, class_memo: Path, extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
    """The folder's tokenizer: a :class:`FileTokenizer` (no transformers import) when these files (all
    but the weights, by :func:`~specsched.models.convert.file_stat`) were found to behave as the
    transformers tokenizer of this transformers version, else that one. The check's verdict and the
    class AutoTokenizer picked are remembered in the JSON file ``class_memo``: the first load of these
    files under this version loads transformers' tokenizer and checks; later loads use the verdict
    (and the class directly)."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return Tokenizer.from_pretrained(folder, extra_eos_token_ids=extra_eos_token_ids)
    memo = StatMemo(class_memo, "tokenizer class cache")
    key = f"{folder.resolve()} (transformers {version})"
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix not in _WEIGHT_SUFFIXES)
    stat = [[f.name, *file_stat(f)] for f in files]
    known, verdict = memo.get(key, stat), memo.get(f"{key} check", stat)
    if verdict == SAME_AS_TRANSFORMERS:
        try:
            return Tokenizer(FileTokenizer(folder, known), extra_eos_token_ids)
        except Exception as e:  # noqa: BLE001 -- transformers serves (e.g. jinja2 or tokenizers changed)
            logger.warning("tokenizer %s: the transformers-free tokenizer failed to load (%s); transformers "
                           "serves", folder, e)  # fmt: skip
    tok = Tokenizer.from_pretrained(folder, extra_eos_token_ids=extra_eos_token_ids, tokenizer_class=known)
    if tok.class_path != known and _transformers_class(tok.class_path) is not None:
        memo.put(key, stat, tok.class_path)
    if verdict is None:
        fast, verdict = _checked_file_tokenizer(folder, tok)
        memo.put(f"{key} check", stat, verdict)
        if fast is not None:
            logger.info("tokenizer %s: the transformers-free tokenizer behaves as transformers' (checked); "
                        "it serves from now on", folder)  # fmt: skip
            return Tokenizer(fast, extra_eos_token_ids)
    if verdict != SAME_AS_TRANSFORMERS:
        logger.info("tokenizer %s: transformers serves (%s)", folder, verdict)
    return tok


def _checked_file_tokenizer(folder: Path, tok: Tokenizer) -> tuple[FileTokenizer | None, str]:
    """A FileTokenizer of ``folder`` and the verdict :data:`SAME_AS_TRANSFORMERS` when it behaves as
    ``tok`` (transformers' tokenizer of the same files) does; else None and why not."""
    from specsched.models.tokenizer_check import differences

    try:
        fast = FileTokenizer(folder, tok.class_path)
        why = differences(fast, tok.hf)
    except Exception as e:  # noqa: BLE001 -- files it does not read: transformers serves
        return None, f"the transformers-free tokenizer cannot load these files: {type(e).__name__}: {e}"[:400]
    if why is not None:
        return None, f"the transformers-free tokenizer differs from transformers': {why}"[:400]
    return fast, SAME_AS_TRANSFORMERS


def _transformers_class(class_path: str) -> type | None:
    """The transformers tokenizer class named ``module:Class``, or None (not transformers', gone)."""
    module, _, name = class_path.partition(":")
    if not module.startswith("transformers.") or not name.isidentifier():
        return None
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError as e:
        logger.debug("tokenizer class %s: %s", class_path, e)
        return None
    return found if isinstance(found, type) and hasattr(found, "from_pretrained") else None


def _tokenizer_adds_bos(hf_tokenizer: Any) -> bool:
    bos = hf_tokenizer.bos_token_id
    if bos is None:
        return False
    probe = "a"
    with_special = list(hf_tokenizer.encode(probe, add_special_tokens=True))
    plain = list(hf_tokenizer.encode(probe, add_special_tokens=False))
    return bool(with_special) and with_special[0] == bos and plain[:1] != [bos]
