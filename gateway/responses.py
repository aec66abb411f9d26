"""The response objects, as OpenAI shapes them: ``chat.completion`` / ``chat.completion.chunk``
(:class:`ChatShape`) and ``text_completion`` (:class:`CompletionShape`), plus the extra field
``specsched`` (the request's speculation counters from the daemon's ``done``), and SSE framing."""

from __future__ import annotations

import json
import time

from specsched.daemon.protocol import Done

# the daemon's finish_reason -> OpenAI's (timeout: the request's deadline cut it, like a token limit)
FINISH_REASONS = {"stop": "stop", "length": "length", "timeout": "length"}
SSE_DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(done: Done) -> dict:
    prompt, completion = done.usage.prompt_tokens, done.usage.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def specsched_extra(done: Done) -> dict:
    """The extra ``specsched`` field: draft tokens proposed / accepted, engine steps, the daemon's reason."""
    s = done.spec
    return {
        "proposed": s.proposed,
        "accepted": s.accepted,
        "steps": s.steps,
        "finish_reason": done.finish_reason,
    }


def finish_reason(done: Done) -> str:
    return FINISH_REASONS.get(done.finish_reason, done.finish_reason)  # abort / error pass through


class Shape:
    """The objects of one request: ``full`` (non-stream), then for a stream ``opening`` (or None),
    ``delta`` per piece of text, ``final`` (finish_reason) and ``usage_chunk``."""

    OBJECT = CHUNK_OBJECT = ""
    ID_PREFIX = ""

    def __init__(self, request_id: str, model: str, include_usage: bool = False) -> None:
        self.id = self.ID_PREFIX + request_id
        self.model, self.include_usage = model, include_usage
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict) -> dict:
        out = {**self._head(self.CHUNK_OBJECT), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # as OpenAI: null on every chunk but the last
        return out

    def full(self, text: str, done: Done) -> dict:
        choice = {"index": 0, **self._content(text), "logprobs": None, "finish_reason": finish_reason(done)}
        return {**self._head(self.OBJECT), "choices": [choice], "usage": usage(done),
                "specsched": specsched_extra(done)}  # fmt: skip

    def opening(self) -> dict | None:
        return None

    def delta(self, text: str) -> dict:
        return self._chunk({"index": 0, **self._piece(text), "logprobs": None, "finish_reason": None})

    def final(self, done: Done) -> dict:
        choice = {"index": 0, **self._piece(None), "logprobs": None, "finish_reason": finish_reason(done)}
        return {**self._chunk(choice), "specsched": specsched_extra(done)}

    def usage_chunk(self, done: Done) -> dict:
        return {**self._head(self.CHUNK_OBJECT), "choices": [], "usage": usage(done),
                "specsched": specsched_extra(done)}  # fmt: skip

    def _content(self, text: str) -> dict:
        raise NotImplementedError

    def _piece(self, text: str | None) -> dict:
        raise NotImplementedError


class ChatShape(Shape):
    OBJECT, CHUNK_OBJECT, ID_PREFIX = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def _content(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def opening(self) -> dict:
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})  # fmt: skip

    def _piece(self, text: str | None) -> dict:
        return {"delta": {} if text is None else {"content": text}}


class CompletionShape(Shape):
    OBJECT, CHUNK_OBJECT, ID_PREFIX = "text_completion", "text_completion", "cmpl-"

    def _content(self, text: str) -> dict:
        return {"text": text}

    def _piece(self, text: str | None) -> dict:
        return {"text": text or ""}
