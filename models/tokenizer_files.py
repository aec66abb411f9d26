"""A model's tokenizer built from its folder's files without transformers (whose import alone is ~2 s of
a start): ``tokenizer.json`` through the ``tokenizers`` package (the Rust tokenizer that transformers'
fast tokenizers wrap), the named special tokens from ``tokenizer_config.json``, and the chat template
rendered with jinja2 the way transformers renders it: a sandboxed (immutable) environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` block
that renders its body, the globals ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``
(no underscore attributes), a ``tojson`` filter that does not escape HTML, and the named special tokens
(``bos_token``, ``eos_token``...) as template variables.

:class:`FileTokenizer` has the part of a transformers tokenizer's interface that
:class:`~specsched.models.tokenizer.Tokenizer` uses. It is served only for files on which
:func:`~specsched.models.tokenizer_check.differences` found it to behave as the transformers tokenizer
of the same files (the loader remembers that verdict; models/tokenizer.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 saves a single chat template here
# the named special tokens, in transformers' order; they are also the chat template's variables
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)  # fmt: skip
MIN_JINJA2 = (3, 1, 6)  # older versions have known sandbox escapes (transformers refuses them too)


class FileTokenizer:
    """Text <-> ids and chat rendering from ``folder``'s ``tokenizer.json``, ``tokenizer_config.json``
    and chat template (``chat_template.jinja``, else the config's ``chat_template`` string).
    ``class_path``: the transformers class these files were checked against (``module:Class``).
    Raises ValueError for files it does not read (several named templates, a special token that is
    neither a string nor an AddedToken map) and ImportError for a jinja2 older than 3.1.6."""

    def __init__(self, folder: str | Path, class_path: str | None = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        folder = Path(folder)
        self.name_or_path = str(folder)
        self.class_path = class_path
        self._tokenizer = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        # transformers' calls without truncation or padding switch both off in the Rust tokenizer
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        self.special_tokens_map: dict[str, str] = {
            name: _token_text(config[name], name)
            for name in SPECIAL_TOKEN_NAMES
            if config.get(name) is not None
        }
        self.chat_template: str | None = _chat_template(folder, config)
        self._template = _compile(self.chat_template) if self.chat_template else None

    # --- the part of transformers' interface that Tokenizer uses -------------------------------------

    def _special_id(self, name: str) -> int | None:
        """The id of the named special token; an unknown token is the unknown token's id (as transformers)."""
        token = self.special_tokens_map.get(name)
        if token is None:
            return None
        found = self._tokenizer.token_to_id(token)
        return found if found is not None or name == "unk_token" else self._special_id("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def all_special_ids(self) -> list[int]:
        """Every id that ``skip_special_tokens`` drops (the added tokens marked special)."""
        return sorted(i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``, through ``encode_batch``: the same ids as ``encode``, but the Rust side
        runs without the interpreter lock (0.17 against 0.25 ms for a 131-token chat on the dev CPU), so
        the daemon's other threads run meanwhile."""
        return list(self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("FileTokenizer.decode does not clean up tokenization spaces")
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
    ) -> str | list[int]:
        """The chat rendered with the template (``tokenize``: encoded without special tokens added)."""
        if return_dict:
            raise ValueError("FileTokenizer.apply_chat_template returns ids or text, not a dict")
        text = self.render_chat(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``: maps of str ``role`` and ``content`` only (those are
        what the engine renders; transformers' handling of other fields is not reproduced)."""
        if self._template is None:
            raise ValueError(f"tokenizer {self.name_or_path!r} has no chat template")
        chat = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or set(m) != {"role", "content"}:
                raise ValueError(f"messages[{i}] must be a map of exactly 'role' and 'content', got {m!r}")
            if not isinstance(m["role"], str) or not isinstance(m["content"], str):
                raise ValueError(f"messages[{i}]: 'role' and 'content' must be strings, got {m!r}")
            chat.append({"role": str.__str__(m["role"]), "content": str.__str__(m["content"])})
        return self._template.render(
            messages=chat,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )


def _token_text(value: Any, name: str) -> str:
    """A special token as the config stores it: a string, or an AddedToken map (``content``)."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        value = value["content"]
    if not isinstance(value, str):
        raise ValueError(f"tokenizer_config.json: {name} is not a string or an AddedToken map: {value!r}")
    return value


def _chat_template(folder: Path, config: dict) -> str | None:
    """The template transformers uses for a chat without tools: ``chat_template.jinja`` first."""
    if (folder / "additional_chat_templates").is_dir() or (folder / "chat_template.json").is_file():
        raise ValueError("named chat templates (additional_chat_templates/, chat_template.json) are not read")
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError("tokenizer_config.json holds several named chat templates; they are not read")
    return template


def _compile(source: str) -> Any:
    """The chat template, compiled in its sandboxed environment (see the module's doc)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    version = tuple(int(p) if p.isdigit() else 0 for p in jinja2.__version__.split(".")[:3])
    if version < MIN_JINJA2:
        raise ImportError(f"chat templates need jinja2 >= 3.1.6 (sandbox fixes), found {jinja2.__version__}")

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks an assistant's text): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses underscore attributes (no way to CPython's internals)."""

        def __init__(*args, **kwargs):  # noqa: N805 -- jinja's own signature, so that namespace(self=1) works
            attrs = dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(args[0], attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: no underscore names")

    class DictMaker:
        """``dict(...)`` and ``dict.fromkeys(...)`` without the type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=DictMaker(),
        namespace=Namespace,
    )
    return env.from_string(source)
