"""The outbox between the engine thread and the IO thread carries lists: one per loop iteration (a
step's chunks in one queue put) and one per release of held final replies; per request the client
still gets its chunks in order and then its ``done``, and with a durable log the ``done`` only once its
row is committed."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from types import SimpleNamespace

import pytest

from specsched.client.sync_client import AsyncClient
from specsched.daemon.messages import Chunk, Done
from specsched.daemon.request_stream import LateText
from specsched.daemon.serving import Serving
from specsched.engine.records import RequestOutput

NUM_CLIENTS, MAX_TOKENS = 8, 12


@pytest.fixture(params=["durable", "no log"])
def server(request, tiny_hf_dir, tmp_path):
    """An in-process server (tiny checkpoint with its tokenizer; a durable log with a 60 s flush
    interval: only a finished request's commit writes, or no log) whose outbox puts are recorded."""
    from specsched.daemon.log import LogWriter
    from specsched.daemon.log_config import LogConfig
    from specsched.daemon.server import DaemonConfig, Server
    from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
    from specsched.engine.engine import Engine

    model = ModelConfig(source=str(tiny_hf_dir), cache_dir=str(tmp_path / "cache"), device="cpu")
    engine = Engine.from_config(
        EngineConfig(
            model=model, cache=CacheConfig(num_blocks=128), spec=SpecConfig(proposer="ngram", max_k=3)
        )
    )
    log = None
    if request.param == "durable":
        log = LogWriter(LogConfig(path=str(tmp_path / "log.sqlite"), flush_interval_s=60.0))
        log.start_run({}, model="tiny", device="cpu", version="test")
    srv = Server(engine, DaemonConfig(endpoint="tcp://127.0.0.1:0", shutdown_grace_s=0.0), log)
    srv.puts = []  # (thread name, item) of every outbox put

    def post(item, put=srv._outbox.put) -> None:
        srv.puts.append((threading.current_thread().name, item))
        put(item)

    srv._serving.post = post
    if log is not None:
        srv._serving.held.post = post
    srv.start()
    yield srv
    srv.request_shutdown()
    assert srv.join(timeout=30)
    srv.close()


async def run_clients(endpoint: str, log_path: str | None, stream: bool) -> list[tuple[str, list[int], list]]:
    """Each client's greedy completion of its prompt: (text, token ids, ids committed at the done)."""

    async def one(i: int):
        async with AsyncClient(endpoint, timeout_s=60) as c:
            prompt = f"The quick brown fox {i} jumps over the lazy dog. Grüße 🚀 {i}"
            if not stream:
                got = await c.generate(prompt, max_tokens=MAX_TOKENS, id=f"g{i}")
                return got.text, got.token_ids, []
            s = c.stream(prompt, max_tokens=MAX_TOKENS, id=f"s{i}")
            chunks = [ch async for ch in s]
            rows = []
            if log_path is not None:  # the done is here: its row must be committed already
                db = sqlite3.connect(log_path)
                rows = [r for (r,) in db.execute("SELECT request_id FROM requests") if r.endswith(f":s{i}")]
                db.close()
            assert s.done.usage.completion_tokens == sum(len(ch.token_ids) for ch in chunks)
            return "".join(ch.text for ch in chunks), [t for ch in chunks for t in ch.token_ids], rows

    return await asyncio.gather(*(one(i) for i in range(NUM_CLIENTS)))


def test_a_steps_chunks_go_in_one_put_in_order(server):
    log_path = server.log.path if server.log is not None else None
    want = asyncio.run(run_clients(server.bound_endpoint, log_path, stream=False))
    server.puts.clear()
    got = asyncio.run(run_clients(server.bound_endpoint, log_path, stream=True))
    assert [(text, ids) for text, ids, _ in got] == [(text, ids) for text, ids, _ in want]
    assert all(isinstance(item, list) and item for _, item in server.puts)
    # a chunk of a request without stop strings travels as a LateText (its text detokenized by the IO
    # thread: request_stream.py); as the client's chunks it is one
    engine = [[(c, m.chunk if isinstance(m, LateText) else m) for c, m in item]
              for name, item in server.puts if name == "specsched-engine"]  # fmt: skip
    chunks = [msg for item in engine for _, msg in item if isinstance(msg, Chunk)]
    assert len(chunks) >= NUM_CLIENTS * MAX_TOKENS // 4
    assert max(sum(isinstance(m, Chunk) for _, m in item) for item in engine) >= NUM_CLIENTS // 2
    assert len(engine) < len(chunks) / 2
    released = [msg for name, item in server.puts if name == "specsched-log" for _, msg in item]
    if log_path is not None:
        assert all(len(rows) == 1 for _, _, rows in got)  # durable: each done after its row's commit
        assert sum(isinstance(m, Done) for m in released) == NUM_CLIENTS  # every done held for it
    else:  # each done in the list of its last chunk, after it
        assert not released
        for item in engine:
            ids = [msg.id for _, msg in item]
            assert all(ids.index(m.id) < i for i, (_, m) in enumerate(item) if isinstance(m, Done))
        assert sum(isinstance(m, Done) for item in engine for _, m in item) == NUM_CLIENTS


class InstantLog:
    """A durable log whose writer settles each record before ``write_request`` returns (a writer thread
    that won the race against the engine thread's post)."""

    is_durable = True

    def __init__(self) -> None:
        self.settled_seq, self.listeners = 0, []

    def on_settled(self, listener) -> None:
        self.listeners.append(listener)

    def write_request(self, *args, **kwargs) -> int:
        self.settled_seq += 1
        for listener in self.listeners:
            listener(self.settled_seq)
        return self.settled_seq

    def write_step(self, rec) -> int:
        return 0


def test_a_final_reply_follows_the_list_with_its_chunks(tiny_tokenizer_dir):
    """The done of a request that finishes in a step is handed to HeldReplies only after the list with
    that step's chunks is posted, however fast the log settles it."""
    from specsched.daemon.limits import DaemonConfig
    from specsched.daemon.request_stream import RequestStream
    from specsched.models.detokenizer import IncrementalDetokenizer
    from specsched.models.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny_tokenizer_dir)
    posts, wakes = [], []
    engine = SimpleNamespace(tokenizer=tok, on_step=None)
    cfg = DaemonConfig(send_pace="loop")  # wake at each flush: this fake engine has no device waits
    serving = Serving(engine, cfg, posts.append, lambda: wakes.append(1), InstantLog())
    for i in range(3):
        st = RequestStream(b"c", f"r{i}", f"k{i}", True, [], 3, 0.0, IncrementalDetokenizer(tok))
        serving.streams[st.key] = st
        serving.by_client[b"c"].add(st.key)
    ids = tok.encode("hello 🚀")[1:]  # without <s>
    for step, reason in ((ids[:2], None), (ids[2:], "length")):
        for i in range(3):
            serving._on_output(RequestOutput(f"k{i}", list(step), finish_reason=reason))
        serving.flush()
    assert all(isinstance(p, list) for p in posts) and len(wakes) == 2
    # resolved in order, as the IO thread does (these requests have no stop strings: LateText)
    assert all(isinstance(msg, LateText) for post in posts[:2] for _, msg in post)
    sent = [msg.resolve() if isinstance(msg, LateText) else msg for post in posts for _, msg in post]
    assert [type(m).__name__ for m in sent] == ["Chunk"] * 6 + ["Done"] * 3
    assert len(posts) == 3  # a step's chunks in one list each, the settled dones in one more
    for i in range(3):
        mine = [m for m in sent if m.id == f"r{i}"]
        assert [type(m) for m in mine] == [Chunk, Chunk, Done]
        assert "".join(m.text for m in mine[:2]) == "hello 🚀"
    serving.flush()
    assert len(posts) == 3 and len(wakes) == 2  # nothing to post: no wake


def test_chunks_are_packed_into_the_bytes_encode_gives(monkeypatch):
    """The IO thread's direct packing of chunks: the bytes of ``encode``, for any text and ids; chunks
    of other values (a tuple, bools, numpy ints) and other messages take ``encode`` itself."""
    import random

    import numpy as np

    from specsched.daemon import io_thread
    from specsched.daemon.protocol import encode

    rng = random.Random(0)
    texts = [
        "",
        " hello",
        "Grüße aus Köln",
        "🚀✨ 👨‍👩‍👧",
        "\x00\ufffd\n\t",
        "日本語のテキスト",
        "x" * 70_000,
    ]
    for _ in range(500):
        ids = [rng.choice([0, 1, 127, 128, 255, 65_535, 65_536, 2**31 - 1]) for _ in range(rng.randint(0, 6))]
        chunk = Chunk(
            f"id-{rng.randrange(10**9)}", ids, rng.choice(texts), rng.randint(0, 300), rng.randint(0, 9)
        )
        assert io_thread.encode_reply(chunk) == encode(chunk)
    odd = [Chunk("a", (1, 2), "t"), Chunk("b", [True], "t"), Chunk("c", [1], "t", proposed=False)]
    assert [io_thread.encode_reply(c) for c in odd] == [encode(c) for c in odd]
    done = Done("d", "stop", None, None)
    assert io_thread.encode_reply(done) == encode(done)
    with pytest.raises(TypeError):
        io_thread.encode_reply(Chunk("e", [np.int64(5)], "t"))  # as encode itself
    monkeypatch.setattr(io_thread, "encode", lambda msg: pytest.fail("encode called"))
    assert io_thread.encode_reply(Chunk("f", [5, 6], "ok", 2, 1)) == msgpack_chunk("f", [5, 6], "ok", 2, 1)


def msgpack_chunk(id_: str, ids: list[int], text: str, proposed: int, accepted: int) -> bytes:
    import msgpack

    fields = {"id": id_, "token_ids": ids, "text": text, "proposed": proposed, "accepted": accepted}
    return msgpack.packb({"v": 1, "type": "chunk", **fields}, use_bin_type=True)
