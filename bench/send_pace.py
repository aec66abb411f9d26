"""What the IO thread's sends cost the engine thread, by ``daemon.send_pace`` (CPU, no GPU needed).

The loop of :mod:`specsched.bench.log_pace` (Python host work that lets go of the interpreter lock
every ~0.1 ms as torch calls do, a fixed device wait without the lock, more host work), with the
daemon's reply path beside it instead of the log: each step posts ``--batch`` chunk messages (a few
token ids and their text, as a streaming step sends) to an outbox, and an IO thread built like the
daemon's (a ZeroMQ poller on a wake socket, ``encode_reply`` per message, a ROUTER socket sending to
a DEALER client in another process that reads everything) sends them. ``loop`` wakes the IO thread as
each step's replies are posted (the default ``daemon.send_pace=loop``); ``step`` wakes it at the next
step's device wait (``send_pace=step``); ``late`` wakes it when that wait has ended (what
``send_pace=step`` did before 2026-12-05 10:10, when the engine's hook ran after verification's host
read instead of before it); ``none`` posts nothing. Modes alternate over ``--rounds``
(the order flipped each round); the table gives the loop's host ms per step beyond the device wait.

``--decide-us D --decide-every E``: every E-th step runs D us of Python that never lets go of the
lock at the start of its device wait, as a goodput decide ahead does while the GPU scores (the device
is done ``--wait-us`` after the wait began, however long the decide ran). ``--switch-ms S ...``: each
send mode runs again under ``sys.setswitchinterval(S ms)`` (``daemon.switch_interval_ms``), as
modes ``loop@S`` / ``step@S``.

    python -m specsched.bench.send_pace [--batch 16] [--steps 3000] [--rounds 2] [--wait-us 800]
        [--decide-us 0 --decide-every 3] [--switch-ms 0.5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import threading
import time

import zmq

from specsched.bench.log_pace import device_wait, host_work, print_modes
from specsched.daemon.io_thread import encode_reply
from specsched.daemon.messages import Chunk

MODES = ("none", "loop", "step", "late")


def _client(endpoint: str, ready) -> None:
    """Another process: a DEALER that reads every reply until it gets the end marker."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"client")
    sock.connect(endpoint)
    sock.send(b"hello")
    ready.set()
    while sock.recv() != b"end":
        pass
    sock.close(0)
    ctx.term()


class Sender:
    """The daemon's IO thread, reduced to its reply path: woken through an inproc socket, it drains the
    outbox (lists of messages) and sends each message encoded."""

    def __init__(self, ctx: zmq.Context, router: zmq.Socket) -> None:
        self.outbox: queue.Queue = queue.Queue()
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_tx.bind("inproc://send-pace-wake")
        self._wake_rx.connect("inproc://send-pace-wake")
        self._router, self._stop = router, False
        self.thread = threading.Thread(target=self._run, name="io", daemon=True)

    def wake(self) -> None:
        self._wake_tx.send(b"")

    def stop(self) -> None:
        self._stop = True
        self.wake()
        self.thread.join()
        self._wake_tx.close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._stop:
            if not poller.poll(100):
                continue
            while self._wake_rx.poll(0):
                self._wake_rx.recv()
            while True:
                try:
                    batch = self.outbox.get_nowait()
                except queue.Empty:
                    break
                for client, msg in batch:
                    self._router.send_multipart([client, encode_reply(msg)], zmq.NOBLOCK)
        self._wake_rx.close(0)


def hold_lock(us: float) -> None:
    """``us`` µs of Python that never lets go of the interpreter lock of its own accord."""
    end = time.perf_counter() + us / 1e6
    x = 0
    while time.perf_counter() < end:
        for i in range(50):
            x += i


def run(mode: str, batch: int, steps: int, wait_us: float, sender: Sender, decide_us: float = 0.0,
        decide_every: int = 3) -> list[float]:  # fmt: skip
    """Host ms per step (the device's time excluded) of ``steps`` loop steps, the first 10 % dropped.
    ``mode``: none | loop | step, optionally ``@S`` (the switch interval in ms while it runs)."""
    mode, _, switch = mode.partition("@")
    old = sys.getswitchinterval()
    if switch:
        sys.setswitchinterval(float(switch) / 1e3)
    try:
        return _run(mode, batch, steps, wait_us, sender, decide_us, decide_every)
    finally:
        sys.setswitchinterval(old)


def _run(mode, batch, steps, wait_us, sender, decide_us, decide_every) -> list[float]:
    out, is_due = [], False
    for step in range(steps):
        t0 = time.perf_counter()
        host_work(80)
        if is_due and mode == "step":  # send_pace=step: the engine's device wait wakes the IO thread
            sender.wake()
            is_due = False
        w0 = time.perf_counter()
        if decide_us and step % decide_every == 0:  # a decide ahead while the device works
            hold_lock(decide_us)
        left = wait_us - (time.perf_counter() - w0) * 1e6
        if left > 0:
            device_wait(left)
        waited = min(time.perf_counter() - w0, wait_us / 1e6)  # the device's part of the wait
        if is_due:  # late: woken once the wait has ended
            sender.wake()
            is_due = False
        host_work(40)
        if mode != "none":
            replies = [(b"client", Chunk(f"r{i}", [step % 50000, 17], " the", 6, 5)) for i in range(batch)]
            sender.outbox.put(replies)
            if mode == "loop":
                sender.wake()
            else:
                is_due = True
        out.append((time.perf_counter() - t0 - waited) * 1e3)
    if is_due:
        sender.wake()
    return out[steps // 10 :]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--wait-us", type=float, default=800.0)
    ap.add_argument("--decide-us", type=float, default=0.0, help="a lock-holding decide ahead, us")
    ap.add_argument("--decide-every", type=int, default=3, help="... every this many steps")
    ap.add_argument("--switch-ms", type=float, nargs="*", default=[], help="switch intervals to add")
    args = ap.parse_args(argv)
    modes = [*MODES, *(f"{m}@{s:g}" for s in args.switch_ms for m in MODES[1:])]
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    ready = mp.get_context("spawn").Event()
    client = mp.get_context("spawn").Process(target=_client, args=(endpoint, ready), daemon=True)
    client.start()
    ready.wait(30)
    router.recv_multipart()  # the client's hello: its identity is routable now
    sender = Sender(ctx, router)
    sender.thread.start()
    got: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for r in range(args.rounds):
            for m in modes if r % 2 == 0 else modes[::-1]:
                got[m] += run(m, args.batch, args.steps, args.wait_us, sender, args.decide_us,
                              args.decide_every)  # fmt: skip
                time.sleep(0.2)  # the last step's replies leave before the next mode
    finally:
        sender.stop()
        router.send_multipart([b"client", b"end"])
        client.join(30)
        router.close(0)
        ctx.term()
    decide = f", a {args.decide_us:.0f} us decide every {args.decide_every} steps" if args.decide_us else ""
    print(
        f"batch {args.batch}, {args.rounds} rounds of {args.steps} steps, device wait {args.wait_us:.0f} us"
        f"{decide}"
    )
    print_modes("daemon.send_pace", "no sends", got)


if __name__ == "__main__":
    main()
