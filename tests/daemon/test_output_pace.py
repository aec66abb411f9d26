"""``daemon.output_pace=window``: a step's outputs and record wait for the next step's forward and are
handled there (the engine's ``on_host_window``), not in the daemon's loop while the device idles. The
replies, their order, the stop strings, cancels, deadlines and the decision log stay what they are
with ``loop``; only where the engine thread does the work moves."""

from __future__ import annotations

import sqlite3

import pytest

from specsched.daemon.admission import request_key
from specsched.daemon.commands import Admit, CancelRequest
from specsched.daemon.limits import DaemonConfig
from specsched.daemon.messages import Chunk, Done, Generate
from specsched.daemon.serving import Serving
from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine

PROMPTS = [[5, 6, 7, 5, 6, 7, 8 + i] for i in range(4)]


def tiny_engine(source: str = "tiny", decode_steps: int = 1) -> Engine:
    spec = SpecConfig(proposer="ngram", max_k=3)
    if decode_steps > 1:  # runs of plain steps: no drafts
        spec = SpecConfig(proposer="none", max_k=0)
    model, sched = ModelConfig(source=source, device="cpu"), SchedulerConfig(decode_steps=decode_steps)
    cfg = EngineConfig(model=model, cache=CacheConfig(num_blocks=64), spec=spec, scheduler=sched)
    return Engine.from_config(cfg)


class Recorder:
    """A Serving on a real engine whose posts are recorded with whether they happened inside the
    engine's host window, and whose engine aborts are checked to come outside it."""

    def __init__(self, engine: Engine, pace: str) -> None:
        self.engine, self.posts, self.is_in_window, self.num_windows = engine, [], False, 0
        cfg = DaemonConfig(endpoint="tcp://127.0.0.1:0", output_pace=pace)
        self.srv = Serving(engine, cfg, self._post, lambda: None)
        self.records: list = []
        self.srv._chained_on_step, engine.on_step = self.records.append, self.srv._on_step  # as run() does
        hook = engine.on_host_window
        if hook is not None:
            engine.on_host_window = lambda: self._in_window(hook)
        abort = engine.abort_request

        def checked_abort(*args, **kwargs):
            assert not self.is_in_window, "abort_request inside a running step"
            return abort(*args, **kwargs)

        engine.abort_request = checked_abort

    def _in_window(self, hook) -> None:
        self.num_windows += 1
        self.is_in_window = True
        try:
            hook()
        finally:
            self.is_in_window = False

    def _post(self, messages: list) -> None:
        self.posts += [(self.is_in_window, self.engine.num_steps, m) for _, m in messages]

    def admit(self, rid: str, **generate) -> None:
        self.srv.handle(Admit(b"c", Generate(rid, **generate), 0.0))

    def loop_once(self) -> None:
        """One iteration of Serving.run without the inbox."""
        self.srv.expire()
        if self.engine.has_unfinished:
            self.srv.step()
        self.srv.flush()

    def run(self) -> None:
        while self.engine.has_unfinished:
            self.loop_once()
        self.srv.drain()
        self.srv.flush()

    def tokens(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for _, _, m in self.posts:
            if isinstance(m, Chunk):
                out.setdefault(m.id, []).extend(m.token_ids)
        return out

    def dones(self) -> dict[str, Done]:
        return {m.id: m for _, _, m in self.posts if isinstance(m, Done)}


def served(pace: str, source: str = "tiny", decode_steps: int = 1, **generate) -> Recorder:
    rec = Recorder(tiny_engine(source, decode_steps), pace)
    for i, p in enumerate(PROMPTS):
        rec.admit(f"r{i}", prompt_ids=p, max_tokens=12 + 3 * i, **generate)
    rec.run()
    return rec


def test_window_pace_handles_each_step_s_outputs_during_the_next_forward():
    loop, window = served("loop"), served("window")
    assert not loop.srv.is_output_deferred and window.srv.is_output_deferred
    assert window.tokens() == loop.tokens() and len(loop.tokens()) == len(PROMPTS)
    assert {k: (d.finish_reason, d.usage.completion_tokens) for k, d in window.dones().items()} == {
        k: (d.finish_reason, d.usage.completion_tokens) for k, d in loop.dones().items()
    }
    assert not any(inside for inside, _, _ in loop.posts)
    inside = [m for is_in, _, m in window.posts if is_in]
    # every chunk but those of the last step (the engine idles after it: handled at once) came from a
    # window; a chunk handled in step n's window was posted before step n ended (num_steps n - 1)
    assert len(inside) >= len(window.posts) - 2 * len(PROMPTS)
    last_step = window.engine.num_steps
    assert all(n < last_step for is_in, n, _ in window.posts if is_in)
    assert any(not is_in and n == last_step for is_in, n, _ in window.posts)


def test_a_run_of_plain_steps_opens_its_window_once_after_its_first_forward():
    loop, window = served("loop", decode_steps=4), served("window", decode_steps=4)
    assert window.tokens() == loop.tokens() and len(loop.tokens()) == len(PROMPTS)
    assert any(r.num_decode_steps > 1 for r in window.records)  # runs ran
    assert window.num_windows == window.engine.num_steps  # one window a step, runs included
    assert any(is_in for is_in, _, _ in window.posts)


def test_auto_pace_defers_only_where_the_engine_overlaps_the_device():
    rec = Recorder(tiny_engine(), "auto")
    assert rec.engine.is_overlapped_observe is False  # CPU: the forward is the host's own work
    assert not rec.srv.is_output_deferred and rec.engine.on_host_window is None


def test_a_stop_string_found_in_the_window_ends_the_request_after_the_step(tiny_hf_dir):
    full = served("loop", str(tiny_hf_dir), stop=["\x00never"])  # text on the engine thread
    text = "".join(m.text for _, _, m in full.posts if isinstance(m, Chunk) and m.id == "r3")
    assert len(text) > 8, text
    stop = text[4:7]
    loop, window = (served(pace, str(tiny_hf_dir), stop=[stop]) for pace in ("loop", "window"))
    for rec in (loop, window):
        got = "".join(m.text for _, _, m in rec.posts if isinstance(m, Chunk) and m.id == "r3")
        assert got == text[: text.find(stop)] and rec.dones()["r3"].finish_reason == "stop"
        assert not rec.engine.requests  # the stopped request left the engine (aborted after its step)
    assert window.tokens() == loop.tokens()


@pytest.mark.parametrize("ending", ["cancel", "deadline"])
def test_a_request_finished_in_the_last_step_is_done_not_cancelled_or_timed_out(ending):
    rec = Recorder(tiny_engine(), "window")
    rec.admit("short", prompt_ids=PROMPTS[0], max_tokens=3)
    rec.admit("long", prompt_ids=PROMPTS[1], max_tokens=40)
    key = request_key(b"c", "short")
    while not any(o.request_id == key and o.finish_reason for o in rec.srv._pending):
        rec.loop_once()
        assert rec.engine.has_unfinished and "short" not in rec.dones()
    assert key not in rec.engine.requests  # finished in the engine; its done is still due
    if ending == "cancel":
        rec.srv.handle(CancelRequest(b"c", "short"))
    else:  # its deadline passes before the next step
        rec.srv.streams[key].deadline = 0.0
        rec.srv.deadlines.insert(0, (0.0, key))
        rec.srv.expire()
    rec.srv.flush()
    assert rec.dones()["short"].finish_reason == "length"
    assert len(rec.tokens()["short"]) == 3
    rec.run()
    assert rec.dones()["long"].finish_reason == "length" and len(rec.tokens()["long"]) == 40


def test_output_pace_is_validated():
    with pytest.raises(ValueError, match="daemon.output_pace must be one of auto, window, loop"):
        DaemonConfig(output_pace="often")


def test_daemon_with_window_pace_streams_every_request_and_logs_every_step(start_daemon, stream_vs_generate):
    d = start_daemon(daemon={"output_pace": "window"}, log_db=True, log={"pace": "step"})
    stream_vs_generate(d.endpoint, [PROMPTS[i % len(PROMPTS)] + [i] for i in range(6)])
    d.stop()
    db = sqlite3.connect(d.log_path)
    num_requests, num_out = db.execute("SELECT count(*), sum(output_tokens) FROM requests").fetchone()
    steps = [row[0] for row in db.execute("SELECT step FROM steps ORDER BY step")]
    num_emitted = db.execute("SELECT sum(num_emitted) FROM steps").fetchone()[0]
    assert (num_requests, num_out) == (12, 120)
    assert steps == list(range(len(steps))) and num_emitted == 120  # every step's record, the last too
