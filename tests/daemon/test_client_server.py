"""The daemon end to end: a real subprocess on loopback, a real engine, the client library."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import time

import pytest

from specsched.client.sync_client import (
    AsyncClient,
    Client,
    Completion,
    ConnectionLost,
    InvalidField,
    PromptTooLong,
    RequestTimeout,
    ServerError,
    ShuttingDown,
    UnknownProposer,
)

LONG = 1500  # max_tokens for requests that are cancelled / abandoned long before they could finish


@pytest.fixture(scope="module")
def reference_engine(tiny_daemon):
    """An in-process engine with exactly the daemon's engine config."""
    from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
    from specsched.engine.engine import Engine

    o = tiny_daemon.options
    cfg = EngineConfig(
        model=ModelConfig(**o["model"]),
        cache=CacheConfig(**o["cache"]),
        scheduler=SchedulerConfig(**o["scheduler"]),
        spec=SpecConfig(**o["spec"]),
    )
    return Engine.from_config(cfg)


def greedy(engine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """The in-process greedy reference (one torch thread, like the daemon: on 2 busy cores, more
    threads only contend)."""
    import torch

    from specsched.engine.request import SamplingParams

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return engine.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
    finally:
        torch.set_num_threads(num_threads)


def prompt(i: int) -> list[int]:
    """Distinct prompts with repeats in them (so the n-gram proposer has something to propose)."""
    base = [3 + (i * 7) % 200, 4 + (i * 11) % 200, 5 + (i * 13) % 200]
    return base * 3 + [9 + i]


def wait_until_idle(client: Client, timeout_s: float = 60.0):
    """Poll ``stats`` until no request is in flight; return the last reply."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if stats.num_inflight == 0 and stats.num_running == 0 and stats.num_waiting == 0:
            return stats
        assert time.monotonic() < deadline, f"daemon still busy after {timeout_s} s: {stats}"
        time.sleep(0.05)


def test_health_and_stats(tiny_daemon):
    with Client(tiny_daemon.endpoint, timeout_s=60) as c:
        h = c.health()
        assert (h.status, h.model) == ("ok", "tiny") and h.uptime_s > 0
        s = c.stats()
        assert s.num_total_blocks == tiny_daemon.options["cache"]["num_blocks"] - 1  # block 0 is reserved
        assert 0 <= s.num_free_blocks <= s.num_total_blocks and s.uptime_s >= h.uptime_s


def test_greedy_over_zmq_equals_in_process_generate(tiny_daemon, reference_engine):
    prompts, lens = [prompt(0), prompt(1)], [12, 7]
    expected = greedy(reference_engine, prompts, lens)
    with Client(tiny_daemon.endpoint, timeout_s=60) as c:
        for p, n, want in zip(prompts, lens, expected, strict=True):
            got = c.generate(prompt_ids=p, max_tokens=n)
            assert isinstance(got, Completion)
            assert got.token_ids == want
            assert got.finish_reason == ("length" if len(want) == n else "stop")
            assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(p), len(want))
            assert 0 <= got.spec.accepted <= got.spec.proposed and 1 <= got.spec.steps <= len(want)
            assert got.text == ""  # the tiny preset has no tokenizer

            stream = c.stream(prompt_ids=p, max_tokens=n)
            chunks = list(stream)
            assert [t for ch in chunks for t in ch.token_ids] == want
            assert all(ch.id == stream.id for ch in chunks)
            assert stream.done.finish_reason == got.finish_reason and stream.done.text is None
            assert stream.completion.token_ids == want
            assert sum(ch.proposed for ch in chunks) == stream.done.spec.proposed
            assert sum(ch.accepted for ch in chunks) == stream.done.spec.accepted


@pytest.mark.slow
def test_32_concurrent_requests_from_several_clients(tiny_daemon, reference_engine):
    n_clients, per_client = 4, 8
    prompts = [prompt(10 + i) for i in range(n_clients * per_client)]
    lens = [3 + i % 9 for i in range(len(prompts))]
    expected = greedy(reference_engine, prompts, lens)

    async def one_client(k: int) -> list[Completion]:
        async with AsyncClient(tiny_daemon.endpoint, timeout_s=120) as c:

            async def run(i: int) -> Completion:
                if i % 2:  # half streamed, half not
                    s = c.stream(prompt_ids=prompts[i], max_tokens=lens[i], id=f"c{k}-r{i}")
                    async for _ in s:
                        pass
                    return s.completion
                return await c.generate(prompt_ids=prompts[i], max_tokens=lens[i], id=f"c{k}-r{i}")

            return await asyncio.gather(*(run(k * per_client + j) for j in range(per_client)))

    async def main():
        return [x for xs in await asyncio.gather(*(one_client(k) for k in range(n_clients))) for x in xs]

    results = asyncio.run(main())
    assert [r.id for r in results] == [f"c{i // per_client}-r{i}" for i in range(len(prompts))]
    for r, want in zip(results, expected, strict=True):
        assert r.token_ids == want, r.id
    with Client(tiny_daemon.endpoint, timeout_s=60) as c:
        stats = wait_until_idle(c)
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.num_requests_done >= len(prompts)
        assert stats.tokens_per_s > 0 and "ngram" in stats.proposers


def test_cancel_mid_stream(tiny_daemon):
    with Client(tiny_daemon.endpoint, timeout_s=60) as c:
        stream = c.stream(prompt_ids=prompt(40), max_tokens=LONG)
        first = next(stream)
        assert first.token_ids
        c.cancel(stream.id)
        rest = list(stream)
        done = stream.done
        assert done.finish_reason == "abort"
        assert done.usage.completion_tokens == len(first.token_ids) + sum(len(ch.token_ids) for ch in rest)
        assert done.usage.completion_tokens < LONG
        stats = wait_until_idle(c)
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_requests_aborted >= 1


def test_client_vanishing_mid_stream_frees_its_blocks(tiny_daemon):
    with Client(tiny_daemon.endpoint, timeout_s=60) as observer:
        aborted_before = observer.stats().num_requests_aborted
        gone = Client(tiny_daemon.endpoint, timeout_s=60)
        streams = [gone.stream(prompt_ids=prompt(50 + i), max_tokens=LONG) for i in range(3)]
        next(streams[0])
        busy = observer.stats()
        assert busy.num_free_blocks < busy.num_total_blocks
        gone.close()  # the socket closes: the daemon's next send to it fails
        stats = wait_until_idle(observer)
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.num_requests_aborted >= aborted_before + 3


def test_bad_requests_get_typed_errors_and_the_daemon_keeps_serving(tiny_daemon):
    with Client(tiny_daemon.endpoint, timeout_s=60) as c:
        with pytest.raises(InvalidField, match="max_tokens") as info:
            c.generate(prompt_ids=[1, 2], max_tokens=-1)
        assert info.value.code == "invalid_field" and isinstance(info.value, ServerError)
        with pytest.raises(InvalidField, match="temperature"):
            c.generate(prompt_ids=[1, 2], temperature=float("nan"))
        with pytest.raises(UnknownProposer, match="ngram"):  # the message lists the known ones
            c.generate(prompt_ids=[1, 2], spec={"proposer": "nope"})
        with pytest.raises(PromptTooLong):
            c.generate(prompt_ids=[7] * (tiny_daemon.options["daemon"]["max_prompt_tokens"] + 1))
        with pytest.raises(InvalidField, match="prompt_ids"):  # the tiny vocabulary has 256 ids
            c.generate(prompt_ids=[1, 300])
        with pytest.raises(InvalidField, match="tokenizer"):
            c.generate("text needs a tokenizer")
        with pytest.raises(ValueError, match="id"):  # checked before sending
            c.generate(prompt_ids=[1], id="")
        assert c.generate(prompt_ids=[1, 2, 3], max_tokens=2).usage.completion_tokens >= 1


def test_timeout_raises_request_timeout_and_cancels_the_request(tiny_daemon):
    with Client(tiny_daemon.endpoint, timeout_s=0.2) as c:
        with pytest.raises(RequestTimeout) as info:
            c.generate(prompt_ids=prompt(60), max_tokens=LONG)
        assert isinstance(info.value, TimeoutError) and info.value.code == "timeout"
    with Client(tiny_daemon.endpoint, timeout_s=60) as c:
        stats = wait_until_idle(c)  # the timed-out request was cancelled, not left running
        assert stats.num_free_blocks == stats.num_total_blocks


def test_many_requests_in_flight_on_one_sync_client(tiny_daemon, reference_engine):
    prompts, lens = [prompt(70 + i) for i in range(3)], [5, 9, 4]
    expected = greedy(reference_engine, prompts, lens)
    with Client(tiny_daemon.endpoint, timeout_s=60) as c:
        streams = [c.stream(prompt_ids=p, max_tokens=n) for p, n in zip(prompts, lens, strict=True)]
        for s in reversed(streams):  # replies for the others are buffered meanwhile
            list(s)
        assert [s.completion.token_ids for s in streams] == expected
        assert c.stats().num_inflight == 0


def test_breaking_out_of_a_stream_cancels_the_request(tiny_daemon):
    with Client(tiny_daemon.endpoint, timeout_s=60) as c:
        aborted = c.stats().num_requests_aborted
        for _ in c.stream(prompt_ids=prompt(75), max_tokens=LONG):
            break  # the stream object is dropped unfinished: the client cancels it at its next call
        stats = wait_until_idle(c)
        assert stats.num_requests_aborted == aborted + 1

    async def main():
        async with AsyncClient(tiny_daemon.endpoint, timeout_s=60) as c:
            aborted = (await c.stats()).num_requests_aborted
            async for _ in c.stream(prompt_ids=prompt(76), max_tokens=LONG):
                break
            for _ in range(600):
                stats = await c.stats()
                if stats.num_inflight == 0:
                    return stats.num_requests_aborted - aborted
                await asyncio.sleep(0.05)

    assert asyncio.run(main()) == 1


def test_in_process_server_on_an_ipc_endpoint(tmp_path):
    """Embedding API (start / request_shutdown / join / close) and an ipc:// endpoint."""
    from specsched.daemon.server import DaemonConfig, Server
    from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig
    from specsched.engine.engine import Engine

    engine = Engine.from_config(
        EngineConfig(model=ModelConfig(source="tiny"), cache=CacheConfig(num_blocks=32))
    )
    server = Server(engine, DaemonConfig(endpoint=f"ipc://{tmp_path}/specsched.sock", shutdown_grace_s=0))
    server.start()
    try:
        assert server.bound_endpoint.startswith("ipc://")
        with Client(server.bound_endpoint, timeout_s=60) as c:
            assert c.generate(prompt_ids=[1, 2, 3], max_tokens=3).usage.completion_tokens >= 1
            stream = c.stream(prompt_ids=[4, 5, 6], max_tokens=LONG)
            next(stream)
            server.request_shutdown()
            list(stream)
            assert stream.done.finish_reason == "abort"
        assert server.join(timeout=30)
    finally:
        server.close()


def test_daemon_config_rejects_bad_values():
    from specsched.daemon.server import DaemonConfig

    with pytest.raises(ValueError, match="daemon.endpoint"):
        DaemonConfig(endpoint="localhost:5555")
    with pytest.raises(ValueError, match="daemon.max_inflight_per_client"):
        DaemonConfig(max_inflight_per_client=0)
    with pytest.raises(ValueError, match="daemon.shutdown_grace_s"):
        DaemonConfig(shutdown_grace_s=-1)
    with pytest.raises(ValueError, match="daemon.max_prompt_tokens"):
        DaemonConfig(max_prompt_tokens=0)


# ---- a model with a tokenizer: text prompts, chat, incremental text, stop strings ----------------


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_dir):
    from specsched.models.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tiny_hf_dir)


def test_text_prompt_and_chat(text_daemon, tokenizer):
    with Client(text_daemon.endpoint, timeout_s=60) as c:
        got = c.generate("The quick brown fox", max_tokens=24)
        assert got.usage.prompt_tokens == len(tokenizer.encode("The quick brown fox"))
        assert got.text == tokenizer.decode(got.token_ids)
        stream = c.stream("The quick brown fox", max_tokens=24)
        chunks = list(stream)
        assert "".join(ch.text for ch in chunks) == got.text
        assert [t for ch in chunks for t in ch.token_ids] == got.token_ids

        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße!"}]
        got = c.generate(messages=chat, max_tokens=8)
        assert got.usage.prompt_tokens == len(tokenizer.apply_chat_template(chat))
        by_ids = c.generate(prompt_ids=tokenizer.apply_chat_template(chat), max_tokens=8)
        assert got.token_ids == by_ids.token_ids and got.text == by_ids.text


def test_stop_strings_cut_the_text_before_the_match(text_daemon):
    with Client(text_daemon.endpoint, timeout_s=60) as c:
        full = c.generate("Speculative decoding", max_tokens=48)
        clean = [k for k in range(4, len(full.text) - 3) if full.text[k : k + 3].isprintable()]
        assert clean, f"no usable stop string in {full.text!r}"
        stop = full.text[clean[len(clean) // 2] : clean[len(clean) // 2] + 3]
        want = full.text[: full.text.find(stop)]

        got = c.generate("Speculative decoding", max_tokens=48, stop=[stop, "\x00never"])
        assert (got.finish_reason, got.text) == ("stop", want)
        assert got.token_ids == full.token_ids[: len(got.token_ids)]
        assert len(got.token_ids) < len(full.token_ids)

        stream = c.stream("Speculative decoding", max_tokens=48, stop=[stop])
        assert "".join(ch.text for ch in stream) == want and stream.done.finish_reason == "stop"


@pytest.mark.parametrize("stop", ["lazy", "ü", "🚀", "dog. G", "The", "never there"])
def test_streamed_text_with_stop_strings_for_every_way_of_splitting_the_tokens(tiny_tokenizer_dir, stop):
    """The engine-thread side on its own: however the tokens are grouped into steps, the text sent
    is exactly the full text cut before the first stop string, and nothing after it is ever sent."""
    import random

    from specsched.daemon.request_stream import RequestStream
    from specsched.models.detokenizer import IncrementalDetokenizer
    from specsched.models.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny_tokenizer_dir)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Grüße 🚀 done")
    text = tok.decode(ids)
    want = text[: text.find(stop)] if stop in text else text
    rng = random.Random(0)
    for trial in range(20):
        cuts = sorted(rng.sample(range(1, len(ids)), k=min(len(ids) - 1, trial % 7)))
        steps = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
        st = RequestStream(b"c", "r", "k", True, [stop, "\x00"], 3, 0.0, IncrementalDetokenizer(tok))
        sent, is_hit = [], False
        for i, step in enumerate(steps):
            piece, is_hit = st.advance(step, finishing=i == len(steps) - 1)
            sent.append(piece)
            if is_hit:
                break
        assert "".join(sent) == want, (steps, sent)
        assert is_hit == (stop in text)
        assert st.advance([], finishing=True) == ("", is_hit)  # nothing left over


def test_streamed_text_without_stop_strings_is_sent_as_it_completes(tiny_tokenizer_dir):
    """No stop strings (the path that holds nothing back): each step sends exactly the text its
    tokens complete (what the detokenizer returns, the flush on the last step), the pieces add up to
    the full text, and the stream's text and sent count follow."""
    import random

    from specsched.daemon.request_stream import RequestStream
    from specsched.models.detokenizer import IncrementalDetokenizer
    from specsched.models.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny_tokenizer_dir)
    full = tok.encode("The quick brown fox jumps over the lazy dog. Grüße 🚀 done")
    cut = tok.encode("done 🚀")[:-1]  # ends inside the emoji: held back until the flush
    rng = random.Random(1)
    for trial in range(40):
        ids = full if trial % 2 else cut
        text = tok.decode(ids) if ids is full else None
        cuts = sorted(rng.sample(range(1, len(ids)), k=min(len(ids) - 1, trial % 7)))
        steps = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
        st = RequestStream(b"c", "r", "k", True, [], 3, 0.0, IncrementalDetokenizer(tok))
        ref = IncrementalDetokenizer(tok)
        sent = []
        for i, step in enumerate(steps):
            is_last = i == len(steps) - 1
            piece, is_hit = st.advance(step, finishing=is_last)
            assert piece == ref.push(step) + (ref.flush() if is_last else "") and not is_hit
            sent.append(piece)
            assert st.num_sent_chars == len(st.text) == len("".join(sent))
        assert "".join(sent) == st.text, (steps, sent)
        assert st.text == text if ids is full else st.text.endswith("\ufffd") and sent[-1], (steps, sent)
        assert st.token_ids == ids
        assert st.advance([], finishing=True) == ("", False)


# ---- lifecycle: each test runs its own daemon ------------------------------------------------------


@pytest.mark.slow
def test_sigterm_mid_run_aborts_in_flight_requests_and_exits_0(start_daemon):
    d = start_daemon(daemon={"shutdown_grace_s": 1.5}, log_db=True)
    with Client(d.endpoint, timeout_s=60) as c, Client(d.endpoint, timeout_s=60) as late:
        short = c.generate(prompt_ids=prompt(80), max_tokens=4)
        stream = c.stream(prompt_ids=prompt(81), max_tokens=LONG)
        next(stream)
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert late.health().status == "shutting_down"
        with pytest.raises(ShuttingDown):
            late.generate(prompt_ids=[1, 2], max_tokens=2)
        list(stream)
        assert stream.done.finish_reason == "abort"
        assert d.proc.wait(60) == 0, d.output()
    assert "clean exit" in d.output()
    db = sqlite3.connect(d.log_path)
    rows = dict(db.execute("SELECT request_id, finish_reason FROM requests").fetchall())
    reasons = {k.split(":", 1)[1]: v for k, v in rows.items()}
    assert reasons == {short.id: short.finish_reason, stream.id: "abort"}
    assert db.execute("SELECT COUNT(*) FROM steps").fetchone()[0] > 0


@pytest.mark.slow
def test_connection_lost_when_the_daemon_dies(start_daemon):
    d = start_daemon()

    async def main():
        async with AsyncClient(d.endpoint, timeout_s=60) as c:
            stream = c.stream(prompt_ids=prompt(90), max_tokens=LONG)
            await stream.__anext__()
            d.proc.kill()
            t0 = time.monotonic()
            with pytest.raises(ConnectionLost) as info:
                async for _ in stream:
                    pass
            assert isinstance(info.value, ConnectionError)
            return time.monotonic() - t0

    assert asyncio.run(main()) < 30  # the socket monitor noticed; no timeout needed
    d.proc.wait(10)
