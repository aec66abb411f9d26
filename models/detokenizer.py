"""Streaming a growing token sequence's text (:class:`IncrementalDetokenizer`), over any tokenizer with
:class:`TokenDecoder`'s few members (:class:`~specsched.models.tokenizer.Tokenizer` has them, and checks
whether ``tokenizers``' Rust ``DecodeStream`` may stream its text: ``Tokenizer.stream_class``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence
logger = logging.getLogger(__name__)


class TokenDecoder(Protocol):
    """What the detokenizer reads of a tokenizer."""

    name: str
    _backend: Any  # the Rust tokenizer a DecodeStream steps over (when stream_class gives one)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def stream_class(self, skip_special_tokens: bool) -> Any | None: ...


class IncrementalDetokenizer:
    """Streams the text of a growing token sequence.

    ``push(new_ids)`` returns only the text the new ids complete. It decodes a short window
    ``ids[prefix_offset:]`` and compares it with ``ids[prefix_offset:read_offset]`` (already
    emitted), so tokenizers whose pieces decode differently at the start of a string (SentencePiece
    drops a leading space) stay consistent; text ending in U+FFFD (an incomplete UTF-8 sequence from
    byte-level tokens, or a partial token) is held back until later ids complete it. ``flush()``
    returns whatever is still held (at the end of a request). For ids that decode to valid UTF-8,
    ``"".join(pushes) + flush() == tokenizer.decode(all ids)``.

    Where the tokenizer's check found it exact (``tokenizer.stream_class``), pushes go through
    ``tokenizers``' ``DecodeStream`` (the same window rule in Rust, its emitted prefix kept instead of
    decoded again: ~1.3 instead of ~3.3 us per one-token push); the offsets here follow it, so
    ``flush()``, and any push after a stream error, continue on the Python path from the same state.
    """

    def __init__(
        self, tokenizer: TokenDecoder, skip_special_tokens: bool = True, stream: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.prefix_offset = 0  # window start: first id of the last emitted chunk
        self.read_offset = 0  # ids before this are emitted
        cls = tokenizer.stream_class(skip_special_tokens) if stream else None
        self._stream = cls(skip_special_tokens=skip_special_tokens) if cls is not None else None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, hold_incomplete: bool) -> str:
        done = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.token_ids[self.prefix_offset :])
        if len(window) <= len(done) or (hold_incomplete and window.endswith(REPLACEMENT_CHAR)):
            return ""
        new = window[len(done) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += new
        return new

    def push(self, new_ids: Iterable[int]) -> str:
        """Append token ids; return the newly completed text ('' when it is held back)."""
        if self._stream is None:
            self.token_ids.extend(int(i) for i in new_ids)
            return self._advance(hold_incomplete=True)
        ids = [int(i) for i in new_ids]
        if not ids:  # the window is unchanged: it was held or equals what was emitted
            return ""
        self.token_ids += ids
        try:
            new = self._stream.step(self.tokenizer._backend, ids)
        except Exception as e:  # noqa: BLE001 -- e.g. the window no longer starts with the emitted text
            self._stream_failed(e)
            return self._advance(hold_incomplete=True)  # from the state before this push: as today
        if new is None:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += new
        return new

    def flush(self) -> str:
        """Return the held-back text (incomplete characters included, as U+FFFD)."""
        self._stream = None  # the stream would not know what this emits: the Python path from here
        return self._advance(hold_incomplete=False)

    def _stream_failed(self, e: Exception) -> None:
        """This request's stream goes on in Python, from the same state (the texts stay today's)."""
        self._stream = None
        logger.debug("tokenizer %s: DecodeStream failed (%s: %s); this request's text goes on in Python",
                     self.tokenizer.name, type(e).__name__, e)  # fmt: skip
