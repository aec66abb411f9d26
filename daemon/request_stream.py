"""One admitted request as the engine thread tracks it: its text (detokenized incrementally, cut at a
stop string), what was sent to the client, and its speculation counters; and :class:`LateText`, a
streamed chunk whose text the IO thread detokenizes.

A request without stop strings never needs its text on the engine thread (*deferred text*,
:attr:`RequestStream.is_text_deferred`): streamed, each chunk goes out as a :class:`LateText` that the
IO thread turns into the chunk with its text (the request's detokenizer is then the IO thread's alone);
not streamed, its ids are detokenized once, when it finishes, for its ``done``. At N = 64 the
incremental detokenization was ~2.6 us a request a step on the engine thread (dev CPU, SmolLM2), ~0.17
ms of every step; the IO thread does it while the engine waits for the device (``daemon.send_pace``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specsched.daemon.messages import Chunk, Done, SpecUsage, Usage
from specsched.models.detokenizer import IncrementalDetokenizer


@dataclass
class RequestStream:
    """One admitted request as the daemon tracks it (text, stop strings, what was sent)."""

    client: bytes
    id: str  # the client's id
    key: str  # the engine's request id (unique across clients)
    is_streaming: bool
    stop: list[str]
    num_prompt_tokens: int
    arrival_time: float
    detok: IncrementalDetokenizer | None
    deadline: float | None = None  # time.monotonic() after which it finishes with "timeout"
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # all text so far (cut before a stop string)
    num_sent_chars: int = 0
    is_stopped: bool = False  # a stop string matched
    first_token_time: float | None = None
    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    is_flushed: bool = False  # deferred text: the last LateText, the one that flushes, was sent
    prompt_hash: str | None = None  # engine.log_schema.prompt_hash of its prompt (the log's requests row)

    @property
    def is_text_deferred(self) -> bool:
        """The engine thread never reads this request's text (no stop strings to match): the IO thread
        detokenizes its chunks (:class:`LateText`), or :meth:`deferred_text` at its end."""
        return self.detok is not None and not self.stop

    def deferred_text(self) -> str:
        """A deferred, unstreamed request's whole text (at its end: its ids detokenized in one push)."""
        self.text = self.detok.push(self.token_ids) + self.detok.flush()
        return self.text

    def advance(self, new_ids: list[int], finishing: bool) -> tuple[str, bool]:
        """Take new ids; return (text to send now, whether a stop string matched). Until the request
        finishes, the last ``max(len(stop)) - 1`` characters are held back: they may start a stop
        string that later tokens complete, and text after a stop string is never sent."""
        self.token_ids.extend(new_ids)
        if self.detok is None or self.is_stopped:
            return "", self.is_stopped
        if not self.stop:  # nothing held back: the new text is what goes out (num_sent_chars == len(text))
            new = self.detok.push(new_ids) + (self.detok.flush() if finishing else "")
            if new:
                self.text += new
                self.num_sent_chars = len(self.text)
            return new, False
        old_len = len(self.text)
        self.text += self.detok.push(new_ids) + (self.detok.flush() if finishing else "")
        if self.stop and len(self.text) > old_len:
            start = max(0, old_len - max(map(len, self.stop)) + 1)
            hits = [p for p in (self.text.find(s, start) for s in self.stop) if p >= 0]
            if hits:
                self.text, self.is_stopped = self.text[: min(hits)], True
        if finishing or self.is_stopped or not self.stop:
            end = len(self.text)
        else:
            end = max(self.num_sent_chars, len(self.text) - max(map(len, self.stop)) + 1)
        out, self.num_sent_chars = self.text[self.num_sent_chars : end], end
        return out, self.is_stopped

    def done(self, reason: str) -> Done:
        """The request's ``done`` message (with the whole output when it was not streamed)."""
        return Done(
            self.id,
            reason,
            Usage(self.num_prompt_tokens, len(self.token_ids)),
            SpecUsage(self.proposed, self.accepted, self.steps),
            text=None if self.is_streaming else self.text,
            token_ids=None if self.is_streaming else list(self.token_ids),
        )


@dataclass
class LateText:
    """A chunk of a deferred-text request (:attr:`RequestStream.is_text_deferred`) on its way to the IO
    thread, which calls :meth:`resolve` in order: the detokenizer is only ever used there."""

    chunk: Chunk  # its text is filled by resolve
    detok: IncrementalDetokenizer
    is_final: bool  # the request finished: flush what the detokenizer holds back

    def resolve(self) -> Chunk:
        detok = self.detok
        self.chunk.text = detok.push(self.chunk.token_ids) + (detok.flush() if self.is_final else "")
        return self.chunk
