"""The gateway when things go wrong: an HTTP client that leaves mid-stream (its request is cancelled
in the daemon, its KV blocks freed), a daemon that is down (503) and comes back on the same endpoint
(the gateway reconnects by itself; a stream cut by the daemon's death ends with an error event), and
the API key (401)."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

from specsched.client import Client

CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def gateway(gateway_daemon, start_gateway):
    return start_gateway(gateway_daemon.endpoint, "health_timeout_s=0.5")


def idle_stats(c: Client, timeout_s: float = 30.0):
    """The daemon's stats once nothing is in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = c.stats()
        if s.num_inflight == s.num_running == s.num_waiting == 0:
            return s
        assert time.monotonic() < deadline, f"daemon still busy after {timeout_s} s: {s}"
        time.sleep(0.02)


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_a_client_leaving_mid_stream_cancels_its_request_and_frees_the_blocks(gateway, gateway_daemon, path):
    # sampled (few drafts accepted): ~230 steps, a second or so, unless the gateway cancels it
    body = {"model": httpx.get(gateway.base_url + "/models").json()["data"][0]["id"], "max_tokens": 5000,
            "temperature": 1.0, "seed": 7, "stream": True}  # fmt: skip
    body.update({"messages": CHAT} if path == "/chat/completions" else {"prompt": "Hello there"})
    with Client(gateway_daemon.endpoint, timeout_s=10) as observer:
        before = idle_stats(observer)
        events = 0
        with httpx.Client(timeout=30) as http, http.stream("POST", gateway.base_url + path, json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                events += line.startswith("data: {")
                if events == 3:
                    break  # leaving the block closes the connection mid-stream
        after = idle_stats(observer)
    assert after.num_requests_aborted == before.num_requests_aborted + 1  # cancelled, not finished
    assert after.num_requests_done == before.num_requests_done
    assert after.num_free_blocks == after.num_total_blocks


def test_a_client_leaving_before_a_non_stream_answer_cancels_its_request(gateway, gateway_daemon):
    body = {"model": httpx.get(gateway.base_url + "/models").json()["data"][0]["id"], "max_tokens": 5000,
            "temperature": 1.0, "seed": 8, "prompt": "Hello there"}  # fmt: skip
    with Client(gateway_daemon.endpoint, timeout_s=10) as observer:
        before = idle_stats(observer)
        with pytest.raises(httpx.ReadTimeout):  # httpx gives up and closes the connection
            httpx.post(gateway.base_url + "/completions", json=body, timeout=httpx.Timeout(5.0, read=0.15))
        after = idle_stats(observer)
    assert after.num_requests_aborted == before.num_requests_aborted + 1
    assert after.num_requests_done == before.num_requests_done
    assert after.num_free_blocks == after.num_total_blocks


def test_a_daemon_that_is_down_gets_503_and_the_gateway_reconnects(gateway, gateway_daemon, start_daemon,
                                                                     text_model):  # fmt: skip
    oai = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=30)
    model = oai.models.list().data[0].id
    stream = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=5000, temperature=1.0, seed=3,
                                         stream=True)  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    assert gateway_daemon.stop(signal.SIGKILL) == -signal.SIGKILL  # the connection drops mid-stream
    with pytest.raises(openai.APIError, match="daemon is unavailable"):  # an error event, then [DONE]
        for _ in chunks:
            pass
    with pytest.raises(openai.APIStatusError) as info:
        oai.chat.completions.create(model=model, messages=CHAT, max_tokens=4)
    assert info.value.status_code == 503 and info.value.code == "daemon_unavailable"
    down = httpx.get(gateway.url + "/health")
    assert down.status_code == 503 and "daemon" in down.json()["error"]["message"]

    start_daemon(model=text_model, endpoint=gateway_daemon.endpoint)  # the same port
    deadline = time.monotonic() + 30
    while httpx.get(gateway.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "the gateway did not reconnect to the restarted daemon"
        time.sleep(0.1)
    got = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0)
    assert got.usage.completion_tokens == 4 and got.choices[0].message.content is not None


def test_an_api_key_is_required_when_configured(gateway_daemon, start_gateway):
    keyed = start_gateway(gateway_daemon.endpoint, "api_key=s3cret")
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=keyed.base_url, api_key="wrong", max_retries=0).models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    bare = httpx.post(keyed.base_url + "/chat/completions", json={"n": 2})  # refused before validation
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    assert bare.json()["error"]["code"] == "invalid_api_key" and "Missing" in bare.json()["error"]["message"]
    assert httpx.get(keyed.url + "/health").status_code == 200  # for load balancers: no key
    oai = openai.OpenAI(base_url=keyed.base_url, api_key="s3cret", max_retries=0, timeout=30)
    model = oai.models.list().data[0].id
    # greedy: sampled at the API's default temperature 1 the tiny random model may end at its first
    # token (a fresh-clone CI run on 2026-12-06: finish "stop" after 1 token)
    got = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=0)
    assert got.usage.completion_tokens == 2
