"""The asyncio client's waits and reads against a scripted peer on a real loopback ROUTER socket: replies
that pile up before the reader runs all arrive in order, streams on one socket stay apart, a reply
that never comes times out and is cancelled on the peer, a wait left early leaves nothing behind, and
a peer that goes away ends the waits with ConnectionLost, a send nobody takes times out, and many
short requests answered at once (replies landing while the client sends) never lose a wake-up."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from specsched.bench.loopback import free_port
from specsched.client.errors import ConnectionLost, RequestTimeout
from specsched.client.sync_client import AsyncClient
from specsched.daemon.protocol import Cancel, Chunk, Done, Generate, SpecUsage, Usage, decode, encode


class Peer:
    """A ROUTER on loopback that the test drives by hand: ``take`` the next request, ``reply`` to it."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.endpoint)

    async def take(self, timeout_s: float = 10.0) -> tuple[bytes, object]:
        """The next message a client sent (its identity and the decoded message), polled without
        blocking the event loop the client runs on."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.sock.poll(0):
            if loop.time() > deadline:
                raise AssertionError("the client sent nothing")
            await asyncio.sleep(0.005)
        client, frame = self.sock.recv_multipart()
        return client, decode(frame)

    def reply(self, client: bytes, *msgs) -> None:
        for msg in msgs:
            self.sock.send_multipart([client, encode(msg)])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def chunk(rid: str, i: int) -> Chunk:
    return Chunk(rid, [i], f"t{i}", proposed=0, accepted=0)


def done(rid: str, n: int) -> Done:
    return Done(rid, "length", Usage(3, n), SpecUsage(0, 0, n))


@pytest.fixture
def peer():
    p = Peer()
    yield p
    p.close()


def test_a_burst_of_chunks_queued_before_the_reader_runs_arrives_whole_and_in_order(peer):
    async def main():
        async with AsyncClient(peer.endpoint, timeout_s=10) as c:
            stream = c.stream(prompt_ids=[1, 2, 3], max_tokens=200, id="a")
            first = asyncio.ensure_future(stream.__anext__())  # sends the generate, waits for a chunk
            client, msg = await peer.take()
            assert isinstance(msg, Generate) and msg.id == "a"
            peer.reply(client, *(chunk("a", i) for i in range(200)), done("a", 200))
            await asyncio.sleep(0.2)  # all of it sits in the socket before the reader reads once more
            got = [(await first).token_ids[0]] + [ch.token_ids[0] async for ch in stream]
            assert got == list(range(200))
            assert stream.done is not None and stream.done.usage.completion_tokens == 200
            assert stream.completion.text == "".join(f"t{i}" for i in range(200))
            assert c._waiting == {}

    asyncio.run(main())


def test_streams_on_one_socket_get_their_own_chunks(peer):
    async def main():
        async with AsyncClient(peer.endpoint, timeout_s=10) as c:

            async def read(rid):
                return [ch.token_ids[0] async for ch in c.stream(prompt_ids=[1], max_tokens=50, id=rid)]

            tasks = [asyncio.ensure_future(read(rid)) for rid in ("a", "b", "c")]
            client = None
            for _ in range(3):
                client, _msg = await peer.take()
            for i in range(50):  # interleaved, as a daemon's steps send them
                for k, rid in enumerate("abc"):
                    peer.reply(client, chunk(rid, 100 * k + i))
                if i % 7 == 0:
                    await asyncio.sleep(0.001)
            peer.reply(client, *(done(rid, 50) for rid in "abc"))
            got = await asyncio.gather(*tasks)
            assert got == [[100 * k + i for i in range(50)] for k in range(3)]

    asyncio.run(main())


def test_a_reply_that_never_comes_times_out_and_is_cancelled_on_the_peer(peer):
    async def main():
        async with AsyncClient(peer.endpoint, timeout_s=0.3) as c:
            stream = c.stream(prompt_ids=[1], max_tokens=8, id="slow")
            task = asyncio.ensure_future(stream.__anext__())
            client, msg = await peer.take()
            peer.reply(client, chunk("slow", 0))
            assert (await task).token_ids == [0]
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(RequestTimeout) as e:
                await stream.__anext__()
            assert 0.25 <= loop.time() - t0 < 5.0
            assert e.value.request_id == "slow"
            _client, cancel = await peer.take()
            assert isinstance(cancel, Cancel) and cancel.id == "slow"
            assert c._waiting == {}

    asyncio.run(main())


def test_a_wait_left_early_leaves_no_waiter_and_the_client_goes_on(peer):
    async def main():
        async with AsyncClient(peer.endpoint, timeout_s=10) as c:
            stream = c.stream(prompt_ids=[1], max_tokens=8, id="gone")
            task = asyncio.ensure_future(stream.__anext__())
            client, _msg = await peer.take()
            await asyncio.sleep(0.05)
            assert "gone" in c._waiting
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert c._waiting == {}
            peer.reply(client, chunk("gone", 1))  # a late reply of the abandoned request is dropped
            other = asyncio.ensure_future(c.generate(prompt_ids=[1], max_tokens=1, id="next"))
            client, msg = await peer.take()
            if isinstance(msg, Cancel):  # the abandoned request's cancel goes out first
                assert msg.id == "gone"
                client, msg = await peer.take()
            assert isinstance(msg, Generate) and msg.id == "next"
            peer.reply(client, Done("next", "length", Usage(1, 1), SpecUsage(0, 0, 1), text="x",
                                    token_ids=[7]))  # fmt: skip
            assert (await other).token_ids == [7]

    asyncio.run(main())


def test_a_peer_that_goes_away_ends_the_wait_with_connection_lost(peer):
    async def main():
        async with AsyncClient(peer.endpoint, timeout_s=30) as c:
            task = asyncio.ensure_future(c.generate(prompt_ids=[1], max_tokens=8, id="w"))
            await peer.take()
            peer.sock.close(0)  # the connection drops: the monitor's event wakes the waiting request
            with pytest.raises(ConnectionLost):
                await asyncio.wait_for(task, 20)

    asyncio.run(main())


def test_a_send_nobody_takes_times_out():
    async def main():
        async with AsyncClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3) as c:  # nobody listens
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(RequestTimeout):
                await c.generate(prompt_ids=[1], max_tokens=1)
            assert loop.time() - t0 < 5.0

    asyncio.run(main())


def echo(peer: Peer, num_chunks: int, stop: threading.Event) -> None:
    """Answer every generate at once with ``num_chunks`` chunks and a done (a thread)."""
    while not stop.is_set():
        if not peer.sock.poll(10):
            continue
        client, frame = peer.sock.recv_multipart()
        msg = decode(frame)
        if isinstance(msg, Generate):
            peer.reply(client, *(chunk(msg.id, i) for i in range(num_chunks)), done(msg.id, num_chunks))


def test_many_short_requests_answered_at_once_never_lose_a_wake_up(peer):
    stop = threading.Event()
    thread = threading.Thread(target=echo, args=(peer, 3, stop), daemon=True)
    thread.start()

    async def one(c, k):
        for j in range(60):
            got = [ch.token_ids[0] async for ch in c.stream(prompt_ids=[1], max_tokens=3, id=f"{k}-{j}")]
            assert got == [0, 1, 2]

    async def main():
        async with AsyncClient(peer.endpoint, timeout_s=5) as c:  # a lost wake-up: a 5 s timeout
            await asyncio.gather(*(one(c, k) for k in range(8)))

    try:
        asyncio.run(main())
    finally:
        stop.set()
        thread.join()


class NoReaderLoop(asyncio.SelectorEventLoop):
    """An event loop that cannot watch file descriptors (as Windows' proactor loop)."""

    def add_reader(self, fd, callback, *args):
        raise NotImplementedError


def test_a_loop_without_add_reader_is_named_in_the_error(peer):
    async def main():
        async with AsyncClient(peer.endpoint, timeout_s=5) as c:
            with pytest.raises(RuntimeError, match="NoReaderLoop does not.*WindowsSelectorEventLoopPolicy"):
                await c.generate(prompt_ids=[1], max_tokens=1)

    loop = NoReaderLoop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_clients_sharing_a_context_leave_it_open_and_work_on(peer):
    ctx = zmq.Context()

    async def main():
        a = AsyncClient(peer.endpoint, timeout_s=10, context=ctx)
        b = AsyncClient(peer.endpoint, timeout_s=10, context=ctx)
        task = asyncio.ensure_future(a.generate(prompt_ids=[1], max_tokens=1, id="a1"))
        client, _ = await peer.take()
        peer.reply(client, Done("a1", "length", Usage(1, 1), SpecUsage(0, 0, 1), text="x", token_ids=[4]))
        assert (await task).token_ids == [4]
        await a.close()
        assert not ctx.closed  # the caller's context: the client leaves it open
        task = asyncio.ensure_future(b.generate(prompt_ids=[1], max_tokens=1, id="b1"))
        client, _ = await peer.take()
        peer.reply(client, Done("b1", "length", Usage(1, 1), SpecUsage(0, 0, 1), text="y", token_ids=[5]))
        assert (await task).token_ids == [5]
        await b.close()

    try:
        asyncio.run(main())
        assert not ctx.closed
    finally:
        ctx.term()


def test_an_asyncio_context_is_refused_by_name():
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    try:
        with pytest.raises(TypeError, match="plain zmq.Context, got zmq.asyncio.Context"):
            AsyncClient("tcp://127.0.0.1:1", context=ctx)
    finally:
        ctx.term()


def test_reconnect_fails_what_is_pending_and_reads_the_new_socket(peer):
    async def main():
        async with AsyncClient(peer.endpoint, timeout_s=10) as c:
            pending = asyncio.ensure_future(c.generate(prompt_ids=[1], max_tokens=1, id="old"))
            first, _ = await peer.take()
            await c.reconnect()
            with pytest.raises(ConnectionLost):
                await pending
            task = asyncio.ensure_future(c.generate(prompt_ids=[1], max_tokens=1, id="new"))
            second, msg = await peer.take()
            assert second != first and isinstance(msg, Generate) and msg.id == "new"  # a new identity
            done_new = Done("new", "length", Usage(1, 1), SpecUsage(0, 0, 1), text="z", token_ids=[6])
            peer.reply(second, done_new)
            assert (await task).token_ids == [6]

    asyncio.run(main())
