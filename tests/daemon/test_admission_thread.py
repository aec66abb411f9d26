"""A generate's prompt is tokenized on the IO thread when the tokenizer may encode beside the engine
thread (daemon/admission.py ``tokenize_prompt``): the engine thread's loop does not pay for it. Same
ids as before, same errors, and an unexpected failure there falls back to the engine thread."""

from __future__ import annotations

import threading

import pytest

from specsched.client.sync_client import Client

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße aus Köln!"}]


@pytest.fixture
def server(tiny_hf_dir, tmp_path):
    """An in-process server on the tiny checkpoint with its tokenizer; every tokenizer call records the
    thread it ran on (``server.calls``)."""
    from specsched.daemon.server import DaemonConfig, Server
    from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
    from specsched.engine.engine import Engine

    model = ModelConfig(source=str(tiny_hf_dir), cache_dir=str(tmp_path / "cache"), device="cpu")
    spec = SpecConfig(proposer="ngram", max_k=3)
    engine = Engine.from_config(EngineConfig(model=model, cache=CacheConfig(num_blocks=128), spec=spec))
    tok = engine.tokenizer
    assert tok.is_thread_safe  # the tiny checkpoint's files are served by a FileTokenizer
    calls: list[tuple[str, str]] = []
    for name in ("encode", "apply_chat_template"):
        inner = getattr(tok, name)

        def spy(*args, _inner=inner, _name=name, **kwargs):
            calls.append((_name, threading.current_thread().name))
            return _inner(*args, **kwargs)

        setattr(tok, name, spy)
    srv = Server(engine, DaemonConfig(endpoint="tcp://127.0.0.1:0", shutdown_grace_s=0.0))
    srv.calls, srv.tok = calls, tok
    srv.start()
    yield srv
    srv.request_shutdown()
    assert srv.join(timeout=30)
    srv.close()


def test_prompts_and_chats_are_tokenized_on_the_io_thread(server):
    with Client(server.bound_endpoint, timeout_s=60) as c:
        chat = c.generate(messages=CHAT, max_tokens=8)
        text = c.generate("The quick brown fox", max_tokens=8)
        server.calls.clear()
        ids = server.tok.apply_chat_template(CHAT)
        assert chat.usage.prompt_tokens == len(ids)
        assert c.generate(prompt_ids=ids, max_tokens=8).token_ids == chat.token_ids
        assert text.usage.prompt_tokens == len(server.tok.encode("The quick brown fox"))
        server.calls.clear()
        c.generate(messages=CHAT, max_tokens=4)
        c.generate("The quick brown fox", max_tokens=4)
        c.generate(prompt_ids=ids, max_tokens=4)  # sent as ids: nobody tokenizes
    assert server.calls == [("apply_chat_template", "specsched-io"), ("encode", "specsched-io")]


def test_a_tokenizer_error_is_answered_from_the_io_thread_and_serving_goes_on(server, monkeypatch):
    def refuse(messages):
        server.calls.append(("refuse", threading.current_thread().name))
        raise ValueError("the chat template refused these messages: no system turn here")

    with Client(server.bound_endpoint, timeout_s=60) as c:
        monkeypatch.setattr(server.tok, "apply_chat_template", refuse)
        with pytest.raises(Exception, match="generate.messages: the chat template refused") as e:
            c.generate(messages=CHAT, max_tokens=4)
        assert "invalid_field" in str(e.value)
        assert server.calls[-1] == ("refuse", "specsched-io")
        assert c.generate("still serving", max_tokens=4).finish_reason == "length"
        assert c.stats().num_requests_rejected == 1


def test_an_unexpected_failure_on_the_io_thread_leaves_the_request_to_the_engine_thread(server, monkeypatch):
    """A tokenizer bug (not a bad prompt) must not stop the IO thread: the engine thread tokenizes
    the request again and its admission reports what fails there."""
    failures = []

    def flaky(messages, _inner=server.tok.apply_chat_template):
        failures.append(threading.current_thread().name)
        if len(failures) == 1:
            raise RuntimeError("Already borrowed")
        return _inner(messages)

    with Client(server.bound_endpoint, timeout_s=60) as c:
        want = c.generate(messages=CHAT, max_tokens=6).token_ids
        monkeypatch.setattr(server.tok, "apply_chat_template", flaky)
        assert c.generate(messages=CHAT, max_tokens=6).token_ids == want
        assert failures == ["specsched-io", "specsched-engine"]
        assert c.generate("still serving", max_tokens=4).finish_reason == "length"


def test_text_without_stop_strings_is_detokenized_off_the_engine_thread(server, monkeypatch):
    """Streamed: each chunk's text on the IO thread; not streamed: once, at the end (one push);
    with stop strings: on the engine thread, which must match them. The texts are the same."""
    from specsched.models.detokenizer import IncrementalDetokenizer

    pushes: list[tuple[str, int]] = []
    inner = IncrementalDetokenizer.push

    def push(self, ids):
        ids = list(ids)
        pushes.append((threading.current_thread().name, len(ids)))
        return inner(self, ids)

    monkeypatch.setattr(IncrementalDetokenizer, "push", push)
    with Client(server.bound_endpoint, timeout_s=60) as c:
        full = c.generate("The quick brown fox", max_tokens=16)
        assert pushes == [("specsched-engine", 16)]  # one push of all 16 ids, at the end
        assert full.text == server.tok.decode(full.token_ids)
        pushes.clear()
        stream = c.stream("The quick brown fox", max_tokens=16)
        assert "".join(ch.text for ch in stream) == full.text
        assert pushes and {name for name, _ in pushes} == {"specsched-io"}
        pushes.clear()
        stop = c.generate("The quick brown fox", max_tokens=16, stop=["\x00never"])
        assert stop.text == full.text
        assert len(pushes) >= 8 and {name for name, _ in pushes} == {"specsched-engine"}  # step by step
