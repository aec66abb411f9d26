"""The request bodies of ``POST /v1/chat/completions`` and ``POST /v1/completions`` (pydantic, OpenAI
field names), validated as OpenAI does, and their mapping onto the daemon's ``generate`` fields.

Unknown fields are rejected (400, naming the field), as OpenAI does. OpenAI fields the daemon cannot
honour are accepted only at their default value (``n=1``, no penalties, no logprobs, no tools, ...), so a
request is never silently served differently from what it asked for. ``top_k`` is an extension (as in
vLLM). Range checks the daemon makes (stop strings, prompt length) come back as 400 from the daemon.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_SEED = 2**63 - 1
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False  # a last chunk with ``usage`` (and ``choices: []``)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessageIn(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer = system
    content: str | list[TextPart] | None = None  # text, or text parts (joined by newlines)
    name: str | None = None  # accepted, not used
    tool_call_id: str | None = None  # accepted, not used

    def to_daemon(self) -> dict:
        if isinstance(self.content, list):
            return {"role": ROLES[self.role], "content": "\n".join(part.text for part in self.content)}
        return {"role": ROLES[self.role], "content": self.content or ""}


def _only(value: Any, allowed: tuple, what: str) -> Any:
    if value not in allowed:
        raise ValueError(f"{what} is not supported by this server (got {value!r})")
    return value


class SamplingRequest(Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's default: 1
    top_p: float | None = Field(None, ge=0, le=1)  # 0 = greedy
    top_k: int | None = Field(None, ge=0)  # extension; 0 = off
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        return _only(v, (None, 1), "n other than 1")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        return _only(v, (None, 0, 0.0), "a penalty other than 0")

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        return _only(v or None, (None,), "logit_bias")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_tokens: int | None, default_max_tokens: int) -> dict:
        """The daemon's sampling fields (``max_tokens`` given by the endpoint's own field names)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        if top_p == 0:  # the smallest nucleus is the most likely token
            temperature, top_p = 0.0, 1.0
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "max_tokens": max_tokens or default_max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": self.top_k or 0,
            "seed": self.seed,
            "stop": stop,
        }


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        return _only(v or None, (None,), "logprobs")

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        return _only(v or None, (None,), "top_logprobs")

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list | None) -> list | None:
        return _only(v or None, (None,), "tools")

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v: str | dict | None) -> str | dict | None:
        return _only(v, (None, "none"), "tool_choice")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict | None) -> dict | None:
        return _only(v, (None, {"type": "text"}), "response_format other than text")

    def generate_args(self, default_max_tokens: int) -> dict:
        max_tokens = self.max_completion_tokens or self.max_tokens
        return {
            "messages": [m.to_daemon() for m in self.messages],
            **self.sampling(max_tokens, default_max_tokens),
        }


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], (str, list)) and len(v) != 1:
            raise ValueError(f"only one prompt per request is supported (got {len(v)})")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        return _only(v or None, (None,), "echo")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        return _only(v, (None,), "logprobs")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        return _only(v or None, (None,), "suffix")

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, v: int | None) -> int | None:
        return _only(v, (None, 1), "best_of other than 1")

    def generate_args(self, default_max_tokens: int) -> dict:
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):  # a batch of one
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else None
        ids = None if isinstance(prompt, str) else list(prompt)
        return {"prompt": text, "prompt_ids": ids, **self.sampling(self.max_tokens, default_max_tokens)}
