"""The daemon's ZeroMQ server: a ROUTER socket owned by an IO thread, the engine owned by another.

:class:`Server` owns the lifecycle: it binds the ROUTER (CURVE when configured), starts the IO thread
(io_thread.py: receives, validates, answers what it can at once, sends replies) and the engine thread
(serving.py: admission, continuous batching, streaming), and shuts them down. The two threads talk
through queues plus an inproc PAIR socket that wakes the IO thread after every step, so a slow step
never stalls receiving and a flood of messages never stalls the engine.

Limits (daemon/limits.py, docs/operations.md): the IO thread rejects at once what it can judge from
its own counters (duplicate id, in flight per client and in all, queue depth); the engine thread checks
the prompt and output lengths and runs each request's deadline. A non-loopback endpoint needs CURVE
(daemon/auth.py): the server refuses to bind one without it. SIGINT/SIGTERM: stop accepting, give
in-flight requests ``shutdown_grace_s``, abort the rest (their ``done`` says ``abort``), close the log
and the sockets, return.
"""

from __future__ import annotations

import gc
import logging
import queue
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import zmq

from specsched.daemon.affinity import pin_engine_thread
from specsched.daemon.auth import CurveServer, endpoint_host
from specsched.daemon.commands import Shutdown
from specsched.daemon.io_thread import IOThread
from specsched.daemon.limits import DaemonConfig
from specsched.daemon.protocol import HealthReply, StartupStats, StatsReply
from specsched.daemon.serving import Serving
from specsched.engine.heap import FrozenHeap, freeze_heap
from specsched.kernels.compile_watch import compile_watch

if TYPE_CHECKING:
    from specsched.engine.warmup import StartupTimes

logger = logging.getLogger(__name__)
__all__ = ["DaemonConfig", "Server"]


class Server:
    """``Server(engine, cfg, log).serve_forever()`` serves until SIGINT/SIGTERM. In-process use
    (tests, embedding): ``start()``, then ``request_shutdown()`` from any thread, then ``join()``.
    ``startup``: the process's start-up times so far; the server marks ``listening``, logs the
    breakdown and reports it in ``stats``."""

    def __init__(
        self, engine, cfg: DaemonConfig | None = None, log=None, startup: StartupTimes | None = None
    ) -> None:
        self.engine, self.cfg, self.log = engine, cfg or DaemonConfig(), log
        self.startup = startup
        self.startup_stats: StartupStats | None = None  # set once listening (read by the IO thread)
        self.engine_tid: int | None = None  # the engine thread's kernel id, once started (host stats)
        self.bound_endpoint: str | None = None
        self.started_at = time.monotonic()
        self._inbox: queue.Queue = queue.Queue()  # IO -> engine thread: serving commands
        self._outbox: queue.Queue = queue.Queue()  # engine -> IO thread: lists of (client, message)
        self._frozen: FrozenHeap | None = None  # set once listening
        self._serving = Serving(engine, self.cfg, self._outbox.put, self._wake, log)
        self._is_shutting_down = False
        self._engine_done = threading.Event()
        self._engine_error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._ctx: zmq.Context | None = None
        self._router = self._wake_rx = self._wake_tx = None
        self._wake_lock = threading.Lock()  # the engine thread and the log's writer thread both wake
        self._curve: CurveServer | None = None
        self._switch_interval_s: float | None = None  # Python's, to restore at close (switch_interval_ms)

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
        self._frozen = freeze_heap()  # full GC passes skip the start-up heap (engine/heap.py); close thaws
        logger.info("%s", self._frozen.description)
        watch = compile_watch()
        watch.mark_ready()  # start-up is over: a Triton variant built from now on is a serving stall
        logger.info("%d Triton kernel variants built before listening", watch.num_built)
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
        io = IOThread(
            self, self._router, self._wake_rx, self._inbox, self._outbox, self._engine_done,
            tokenizer=getattr(self._serving.engine, "tokenizer", None),
        )  # fmt: skip
        self._threads = [
            threading.Thread(target=self._engine_main, name="specsched-engine", daemon=True),
            threading.Thread(target=io.run, name="specsched-io", daemon=True),
        ]
        if self.startup is not None:  # bound; the threads that answer start next
            self.startup.mark("listening")
            self.startup_stats = StartupStats(**self.startup.to_dict())
        if cfg.switch_interval_ms is not None:
            self._switch_interval_s = sys.getswitchinterval()
            sys.setswitchinterval(cfg.switch_interval_ms / 1e3)
            logger.info("thread switch interval %.3g ms (was %.3g)", cfg.switch_interval_ms,
                        self._switch_interval_s * 1e3)  # fmt: skip
        for t in self._threads:
            t.start()
        self.engine_tid = self._threads[0].native_id
        if cfg.engine_cpu is not None:
            pin_engine_thread(self._threads[0].native_id, cfg.engine_cpu)
        if self.startup is not None:
            logger.info("%s", self.startup.describe())
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
        """Close the log and the sockets, restore the thread switch interval (after :meth:`join`;
        idempotent)."""
        if self._switch_interval_s is not None:
            sys.setswitchinterval(self._switch_interval_s)
            self._switch_interval_s = None
        if self._frozen is not None:
            gc.unfreeze()  # collectable again (matters where servers start and stop in one process)
            self._frozen = None
        if self.log is not None:
            try:
                costs = getattr(self.engine, "costs", None)
                if costs is not None:
                    self.log.save_costs(costs)  # what the models learnt while serving (replaces start-up's)
                self.log.end_run(compile_watch().num_after_ready)
                self.log.close()
            except Exception:  # noqa: BLE001
                logger.exception("closing the decision log failed")
        if self._ctx is not None:
            with self._wake_lock:
                wake_tx, self._wake_tx = self._wake_tx, None
            for sock, linger in ((wake_tx, 0), (self._wake_rx, 0), (self._router, self.cfg.linger_ms)):
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

    def _wake(self) -> None:
        """Wake the IO thread (thread-safe: the lock serializes the socket's users, as zmq requires)."""
        with self._wake_lock:
            if self._wake_tx is None:
                return
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already pending

    # ---- info (read by the IO thread) -------------------------------------------------------------
    def health_reply(self, request_id: str | None) -> HealthReply:
        status = "shutting_down" if self._is_shutting_down else "ok"
        return HealthReply(request_id, status, self.model_name, self.uptime_s)

    @property
    def stats_snapshot(self) -> StatsReply:
        """The engine thread's latest counters (replaced after every loop iteration, never mutated)."""
        return self._serving.snapshot

    @property
    def is_shutting_down(self) -> bool:
        return self._is_shutting_down

    @property
    def num_auth_denied(self) -> int:
        return self._curve.num_denied if self._curve is not None else 0

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at

    @property
    def max_queue(self) -> int:
        return self.engine.cfg.scheduler.max_queue

    @property
    def model_name(self) -> str:
        return str(getattr(self.engine, "model_name", None) or self.engine.cfg.model.source)
