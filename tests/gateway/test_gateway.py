"""The gateway end to end: the real daemon (tiny text model), the real gateway CLI on a loopback port,
and the official ``openai`` package as the client. Answers are compared with what the daemon itself
gives the specsched client for the same request (greedy, so they must be equal)."""

from __future__ import annotations

import httpx
import openai
import pytest

from specsched.client import Client

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def gateway(gateway_daemon, start_gateway):
    return start_gateway(gateway_daemon.endpoint, "max_message_bytes=65536")  # = the test daemon's


@pytest.fixture(scope="module")
def oai(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


@pytest.fixture(scope="module")
def daemon_client(gateway_daemon):
    with Client(gateway_daemon.endpoint, timeout_s=60) as c:
        yield c


def test_models_and_health_name_the_daemons_model(oai, gateway, daemon_client):
    name = daemon_client.health().model
    models = oai.models.list()
    assert [m.id for m in models.data] == [name] and models.data[0].owned_by == "specsched"
    assert oai.models.retrieve(name).id == name
    health = httpx.get(gateway.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["model"] == name


def test_chat_non_stream_is_the_daemons_answer_with_usage_and_speculation_counters(oai, model, daemon_client):
    want = daemon_client.generate(messages=CHAT, max_tokens=24)
    got = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-") and got.model == model
    choice = got.choices[0]
    assert (choice.index, choice.message.role, choice.message.content) == (0, "assistant", want.text)
    assert choice.finish_reason == want.finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.usage.prompt_tokens, 24)
    assert got.usage.total_tokens == want.usage.prompt_tokens + 24
    spec = got.model_extra["specsched"]
    assert spec["steps"] >= 1 and 0 <= spec["accepted"] <= spec["proposed"]
    assert spec["steps"] <= 24 <= spec["steps"] + spec["accepted"]  # a step: one token + accepted drafts


def test_chat_stream_sends_the_same_text_in_chunks_then_usage(oai, model, daemon_client):
    want = daemon_client.generate(messages=CHAT, max_tokens=24)
    options = {"include_usage": True}
    chunks = list(oai.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0,
                                              stream=True, stream_options=options))  # fmt: skip
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 24
    assert last.usage.prompt_tokens == want.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert last.model_extra["specsched"]["steps"] >= 1


def test_completions_text_token_ids_stop_and_stream(oai, model, daemon_client):
    want = daemon_client.generate("Speculative decoding", max_tokens=32, stop=None)
    got = oai.completions.create(model=model, prompt="Speculative decoding", max_tokens=32, temperature=0)
    assert got.object == "text_completion" and got.id.startswith("cmpl-")
    assert got.choices[0].text == want.text and got.usage.completion_tokens == 32
    assert got.model_extra["specsched"]["proposed"] >= got.model_extra["specsched"]["accepted"]

    by_ids = oai.completions.create(model=model, prompt=[5, 6, 7, 5, 6, 7], max_tokens=8, temperature=0)
    assert by_ids.usage.prompt_tokens == 6
    assert by_ids.choices[0].text == daemon_client.generate(prompt_ids=[5, 6, 7, 5, 6, 7], max_tokens=8).text

    clean = [k for k in range(4, len(want.text) - 3) if want.text[k : k + 3].isprintable()]
    assert clean, f"no usable stop string in {want.text!r}"
    stop = want.text[clean[0] : clean[0] + 3]
    cut = oai.completions.create(model=model, prompt="Speculative decoding", max_tokens=32, temperature=0,
                                 stop=stop)  # fmt: skip
    assert cut.choices[0].text == want.text[: want.text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"

    pieces = list(oai.completions.create(model=model, prompt="Speculative decoding", max_tokens=32,
                                         temperature=0, stream=True))  # fmt: skip
    assert "".join(p.choices[0].text for p in pieces) == want.text
    assert pieces[-1].choices[0].finish_reason == "length" and pieces[-1].model_extra["specsched"]["steps"]


def test_developer_role_and_text_parts_are_the_daemons_system_role_and_text(oai, model, daemon_client):
    parts = [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]
    messages = [{"role": "developer", "content": parts}, CHAT[1]]
    got = oai.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    system = {"role": "system", "content": "Be\nbrief."}
    want = daemon_client.generate(messages=[system, CHAT[1]], max_tokens=8)
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens


def test_seeded_sampling_is_reproducible(oai, model):
    def ask():
        return oai.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=1.0,
                                           top_p=0.9, seed=1234).choices[0].message.content  # fmt: skip

    assert ask() == ask()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": []}, "messages"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"extra_body": {"nonsense": 1}}, "nonsense"),
        ({"stop": [""]}, "stop"),  # the daemon's check, mapped to a 400
    ],
)
def test_bad_chat_requests_get_400_with_an_openai_error_body(oai, model, extra, param):
    kwargs = {"model": model, "messages": CHAT, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(**kwargs)
    err = info.value
    assert err.status_code == 400 and err.type == "invalid_request_error" and err.param == param
    assert err.body["message"] and "Value error" not in err.body["message"]


def test_other_errors_unknown_model_long_prompt_bad_json(oai, model, gateway):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-nope", messages=CHAT)
    assert info.value.code == "model_not_found" and model in info.value.message
    with pytest.raises(openai.BadRequestError) as info:  # 512 > the daemon's max_prompt_tokens
        oai.completions.create(model=model, prompt=[5] * 600, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=model, prompt=["one", "two"])
    assert info.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as info:  # the daemon would drop it and the connection
        oai.completions.create(model=model, prompt="x" * 70_000, max_tokens=4)
    assert info.value.code == "request_too_large"
    one = oai.completions.create(model=model, prompt="x", max_tokens=1, temperature=0)  # greedy: no early EOS
    assert one.usage.completion_tokens == 1
    raw = httpx.post(gateway.base_url + "/chat/completions", content=b"{not json",
                     headers={"Content-Type": "application/json"})  # fmt: skip
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.get(gateway.base_url + "/nowhere")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
