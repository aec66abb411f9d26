"""The daemon's ZeroMQ server: a ROUTER socket owned by an IO thread, the engine owned by another.

IO thread: receives frames, decodes and validates them (bad input is answered here and never reaches
the engine), answers ``stats`` / ``health`` from the engine thread's latest snapshot, forwards
``generate`` / ``cancel`` to the engine thread through a queue, and sends what the engine thread
queues. The engine thread (serving.py) wakes it through an inproc PAIR socket after every step, so
replies leave as soon as a step ends and a slow step never stalls receiving.

Limits (daemon/limits.py, docs/operations.md): the IO thread rejects at once what it can judge from
its own counters (duplicate id, in flight per client and in all, queue depth); the engine thread checks
the prompt and output lengths and runs each request's deadline. A non-loopback endpoint needs CURVE
(daemon/auth.py): the server refuses to bind one without it.

A client is considered gone when a send to its identity fails (``ROUTER_MANDATORY``: the peer's
connection is closed, or its send queue is full); its requests are then aborted and their KV blocks
freed. SIGINT/SIGTERM: stop accepting, give in-flight requests ``shutdown_grace_s``, abort the rest
(their ``done`` says ``abort``), close the log and the sockets, return.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import queue
import signal
import threading
import time

import zmq

from specsched.daemon.auth import CurveServer, endpoint_host
from specsched.daemon.limits import DaemonConfig
from specsched.daemon.protocol import (
    Cancel,
    Done,
    Error,
    ErrorCode,
    Generate,
    Health,
    HealthReply,
    Message,
    ProtocolError,
    Stats,
    decode,
    encode,
)
from specsched.daemon.serving import Admit, CancelRequest, DropClient, Serving, Shutdown

logger = logging.getLogger(__name__)
__all__ = ["DaemonConfig", "Server"]


class Server:
    """``Server(engine, cfg, log).serve_forever()`` serves until SIGINT/SIGTERM. In-process use
    (tests, embedding): ``start()``, then ``request_shutdown()`` from any thread, then ``join()``."""

    def __init__(self, engine, cfg: DaemonConfig | None = None, log=None) -> None:
        self.engine, self.cfg, self.log = engine, cfg or DaemonConfig(), log
        self.bound_endpoint: str | None = None
        self.started_at = time.monotonic()
        self._inbox: queue.Queue = queue.Queue()  # IO -> engine thread: serving commands
        self._outbox: queue.Queue = queue.Queue()  # engine -> IO thread: (client, message)
        self._serving = Serving(engine, self.cfg, self._queue_send, self._wake, log)
        self._inflight: dict[bytes, set[str]] = {}  # client -> its request ids the engine holds
        self._num_inflight = 0
        self._num_bad_messages = 0
        self._num_rejected = 0
        self._is_shutting_down = False
        self._engine_done = threading.Event()
        self._engine_error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._ctx: zmq.Context | None = None
        self._router = self._wake_rx = self._wake_tx = None
        self._curve: CurveServer | None = None

    # ---- lifecycle --------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Serve until SIGINT/SIGTERM (handlers installed when called on the main thread; a second
        signal aborts without grace). Returns after a clean shutdown; raises if the engine thread died."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda signum, frame: self._on_signal(signum))
            # a file-size limit (ulimit -f) must fail the log's writes (counted), not kill the daemon
            previous[signal.SIGXFSZ] = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            self.start()
            self.join()
        finally:
            self.close()  # with our handlers still on: a signal now cannot kill the log flush
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self._engine_error is not None:
            raise RuntimeError("the engine thread failed") from self._engine_error

    def start(self) -> None:
        cfg = self.cfg
        cfg.check_auth()  # again: the config may have been changed after it was validated
        self._ctx = zmq.Context()
        try:
            if cfg.curve:
                self._curve = CurveServer(
                    self._ctx, cfg.curve_key_file, cfg.curve_clients, cfg.curve_clients_file
                )
        except BaseException:
            self._ctx.term()
            self._ctx = None
            raise
        self._router = self._ctx.socket(zmq.ROUTER)
        if self._curve is not None:
            self._curve.secure(self._router)
        if ":" in (endpoint_host(cfg.endpoint) or ""):
            self._router.setsockopt(zmq.IPV6, 1)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        self._router.setsockopt(zmq.LINGER, cfg.linger_ms)
        self._router.setsockopt(zmq.SNDHWM, cfg.send_hwm)
        if cfg.heartbeat_ivl_ms:
            self._router.setsockopt(zmq.HEARTBEAT_IVL, cfg.heartbeat_ivl_ms)
            self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, cfg.heartbeat_timeout_ms)
        try:
            self._router.bind(cfg.endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"daemon.endpoint {cfg.endpoint!r}: cannot bind ({e})") from e
        self.bound_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        wake_addr = f"inproc://specsched-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake_addr)
        self.started_at = time.monotonic()
        self._serving.publish()  # a first stats snapshot (the engine thread refreshes it every iteration)
        self._threads = [
            threading.Thread(target=self._engine_main, name="specsched-engine", daemon=True),
            threading.Thread(target=self._io_main, name="specsched-io", daemon=True),
        ]
        for t in self._threads:
            t.start()
        logger.info("specsched daemon listening on %s", self.bound_endpoint)

    def request_shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting; abort what is still running after ``grace_s`` (default: the config's)."""
        self._is_shutting_down = True
        self._inbox.put(Shutdown(self.cfg.shutdown_grace_s if grace_s is None else grace_s))

    def join(self, timeout: float | None = None) -> bool:
        """Wait for both threads to end (in short slices, so signals are handled). True if they did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            while t.is_alive() and (deadline is None or time.monotonic() < deadline):
                t.join(0.2)
        return not any(t.is_alive() for t in self._threads)

    def close(self) -> None:
        """Close the log and the sockets (after :meth:`join`; idempotent)."""
        if self.log is not None:
            try:
                self.log.close()
            except Exception:  # noqa: BLE001
                logger.exception("closing the decision log failed")
        if self._ctx is not None:
            for sock, linger in ((self._wake_tx, 0), (self._wake_rx, 0), (self._router, self.cfg.linger_ms)):
                if sock is not None:
                    sock.close(linger=linger)
            if self._curve is not None:
                self._curve.stop()
                self._curve = None
            self._ctx.term()
            self._ctx = None

    def _on_signal(self, signum: int) -> None:
        grace = 0.0 if self._is_shutting_down else None
        logger.info(
            "signal %d: shutting down (grace %s s)",
            signum,
            grace if grace is not None else self.cfg.shutdown_grace_s,
        )
        self.request_shutdown(grace)

    # ---- engine thread ----------------------------------------------------------------------------
    def _engine_main(self) -> None:
        try:
            self._serving.run(self._inbox)
        except BaseException as e:  # noqa: BLE001 -- reported by serve_forever
            logger.exception("engine thread failed")
            self._engine_error = e
            self._is_shutting_down = True
        finally:
            self._engine_done.set()
            self._wake()

    def _queue_send(self, client: bytes, msg: Message) -> None:
        self._outbox.put((client, msg))

    def _wake(self) -> None:
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # a wake-up is already pending

    # ---- IO thread --------------------------------------------------------------------------------
    def _io_main(self) -> None:
        try:
            self._io_loop()
        except Exception:  # noqa: BLE001 -- without its IO thread the daemon cannot serve: stop it
            logger.exception("IO thread failed; shutting down")
            self.request_shutdown(0.0)
            self._engine_done.wait()
        finally:
            while True:  # generate requests the engine thread never took (it ended first)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, Admit):
                    msg = Error(cmd.msg.id, ErrorCode.SHUTTING_DOWN.value, "the daemon is shutting down")
                    self._send_safely(cmd.client, msg)

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while True:
            events = dict(poller.poll(100))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            self._drain_outbox()
            if self._router in events:
                for _ in range(256):  # then send again: replies are not starved by a flood
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._on_frames(frames)
                    except Exception as e:  # noqa: BLE001 -- a bug: answer it and keep serving
                        logger.exception("handling a message failed")
                        self._send_safely(frames[0], Error(None, ErrorCode.INTERNAL.value, repr(e)))
            if self._engine_done.is_set() and self._outbox.empty():
                break
        self._drain_outbox()

    def _drain_outbox(self) -> None:
        while True:
            try:
                client, msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, (Done, Error)):  # the request's last message
                self._forget(client, msg.id)
            self._send(client, msg)

    def _forget(self, client: bytes, request_id: str | None) -> None:
        ids = self._inflight.get(client)
        if ids is not None and request_id in ids:
            ids.discard(request_id)
            self._num_inflight -= 1
            if not ids:
                del self._inflight[client]

    def _send(self, client: bytes, msg: Message) -> None:
        try:
            payload = encode(msg)
        except Exception as e:  # noqa: BLE001 -- a bug; the client still gets an answer
            logger.exception("encoding a %s failed", msg.TYPE)
            payload = encode(
                Error(getattr(msg, "id", None), ErrorCode.INTERNAL.value, f"encoding failed: {e}")
            )
        try:
            self._router.send_multipart([client, payload], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno not in (errno.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self._client_gone(client, "disconnected" if e.errno == errno.EHOSTUNREACH else "not reading")

    def _send_safely(self, client: bytes, msg: Message) -> None:
        try:
            self._send(client, msg)
        except Exception:  # noqa: BLE001
            logger.exception("sending a %s failed", msg.TYPE)

    def _client_gone(self, client: bytes, why: str) -> None:
        ids = self._inflight.pop(client, None)
        if ids:
            self._num_inflight -= len(ids)
            logger.info("client %s %s: aborting its %d request(s)", client.hex(), why, len(ids))
            self._inbox.put(DropClient(client))

    def _on_frames(self, frames: list[bytes]) -> None:
        client = frames[0]
        try:
            if len(frames) != 2:
                raise ProtocolError(
                    ErrorCode.BAD_MESSAGE,
                    f"expected one frame per message (a DEALER socket), got {len(frames) - 1}",
                )
            msg = decode(frames[1])
        except ProtocolError as e:
            self._num_bad_messages += 1
            return self._error(client, e.request_id, e.code, e.message)
        if isinstance(msg, Generate):
            self._on_generate(client, msg)
        elif isinstance(msg, Cancel):
            if msg.id in self._inflight.get(client, ()):
                self._inbox.put(CancelRequest(client, msg.id))
            else:
                self._error(
                    client, msg.id, ErrorCode.UNKNOWN_ID, f"cancel.id: {msg.id!r} is not in flight here"
                )
        elif isinstance(msg, Stats):
            snap = self._serving.snapshot
            self._send(
                client,
                dataclasses.replace(
                    snap,
                    id=msg.id,
                    uptime_s=self.uptime_s,
                    num_requests_rejected=snap.num_requests_rejected + self._num_rejected,
                    num_bad_messages=self._num_bad_messages,
                    num_log_failures=self.log.num_failures if self.log is not None else 0,
                    num_log_dropped=self.log.num_dropped if self.log is not None else 0,
                    num_auth_denied=self._curve.num_denied if self._curve is not None else 0,
                    num_clients=len(self._inflight),
                    rss_bytes=rss_bytes(),
                ),
            )
        elif isinstance(msg, Health):
            status = "shutting_down" if self._is_shutting_down else "ok"
            self._send(client, HealthReply(msg.id, status, self.model_name, self.uptime_s))

    def _error(self, client: bytes, request_id: str | None, code: ErrorCode, message: str) -> None:
        self._send(client, Error(request_id, code.value, message))

    def _on_generate(self, client: bytes, msg: Generate) -> None:
        ids = self._inflight.get(client, set())
        if self._is_shutting_down:
            code, why = ErrorCode.SHUTTING_DOWN, "the daemon is shutting down and accepts no new requests"
        elif msg.id in ids:
            code, why = ErrorCode.DUPLICATE_ID, f"generate.id: {msg.id!r} is already in flight here"
        elif len(ids) >= self.cfg.max_inflight_per_client:
            code, why = (
                ErrorCode.TOO_MANY_INFLIGHT,
                f"{len(ids)} requests in flight (max_inflight_per_client)",
            )
        elif self._num_inflight >= self.cfg.max_inflight:
            code, why = ErrorCode.OVERLOADED, f"{self._num_inflight} requests in flight (max_inflight)"
        elif self._num_inflight - self._serving.snapshot.num_running >= self.max_queue:
            # every request in flight that is not running is queued (or about to be): judged here, at
            # once; the engine thread checks the exact queue again when it admits the request
            code, why = (
                ErrorCode.OVERLOADED,
                f"the queue is full ({self.max_queue} waiting, scheduler.max_queue)",
            )
        else:
            code, why = None, ""
        if code is not None:
            self._num_rejected += 1
            return self._error(client, msg.id, code, why)
        self._inflight.setdefault(client, set()).add(msg.id)
        self._num_inflight += 1
        self._inbox.put(Admit(client, msg, time.time()))

    # ---- info -------------------------------------------------------------------------------------
    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at

    @property
    def max_queue(self) -> int:
        return self.engine.cfg.scheduler.max_queue

    @property
    def model_name(self) -> str:
        return str(getattr(self.engine, "model_name", None) or self.engine.cfg.model.source)


def rss_bytes() -> int:
    """This process's resident memory (``VmRSS`` of /proc/self/status); 0 where there is none."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
