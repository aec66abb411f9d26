"""What the decision log's writer costs the engine thread, by ``log.pace`` (CPU, no GPU needed).

An engine-like loop on the main thread: Python host work with a call that lets go of the interpreter
lock every few units of it (as torch's launches and event records do), then a fixed device wait
without the lock (a sleep, as the verification read's wait for the GPU; with ``log.pace=step`` the
loop nudges the log first, as Engine.on_device_wait does), more host work, and the step's record on
the real :class:`~specsched.daemon.log.LogWriter` (a durable SQLite log in WAL mode in a temporary
directory; a finished request's row every ``--finish-every`` steps). The records are goodput-sized:
its plan_info keys, ``--batch`` request rows. Per mode (``none`` = no log, ``record``, ``step``;
alternated over ``--rounds`` rounds, the order flipped each round) it prints the loop's ms per step
beyond the device wait: what the writer's Python work cost the engine thread.

    python -m specsched.bench.log_pace [--batch 16] [--steps 3000] [--rounds 2] [--wait-us 800]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from specsched.daemon.log import LogConfig, LogWriter
from specsched.engine.records import StepRecord, StepRequestRecord

PLAN_INFO = {  # the keys and kinds of values of a goodput plan's info (policies/goodput.py)
    **{k: 0.5 for k in ("goodput", "goodput_k0", "runner_up_goodput", "explore_spread", "explore_error")},
    **{f"predicted_{k}_ms": 0.4 for k in ("propose", "score", "verify", "overhead")},
    "reason": "speculating: 4.123 tokens/ms vs 2.456 with k=0",
    "scorer_goodput": {"mqa_graph": 4.1, "mqa": 3.2, "batch_expansion": 2.9},
    "runner_up": "mqa",
    **{k: False for k in ("is_scorer_held", "is_probe", "is_dither", "is_exploring", "is_decode_scorer")},
    "num_k_held": 2, "num_kv_cuts": 0, "is_decode_try": False, "k0_scorer": "mqa_graph",
    "plan_age": 0, "decide_ms": 0.0, "decide_cpu_ms": 0.0, "num_joined": 0, "num_left": 0, "num_reopened": 0,
}  # fmt: skip


def host_work(units: int) -> None:
    """``units`` × ~15 µs of Python, letting go of the interpreter lock every 8 units."""
    x = 0
    for j in range(units):
        for i in range(60):
            x += i
        if j % 8 == 0:
            time.sleep(0)


def device_wait(us: float) -> None:
    """``us`` µs without the interpreter lock."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        time.sleep(0.0001)


def run(pace: str, batch: int, steps: int, wait_us: float, finish_every: int) -> list[float]:
    """Host ms per step (the device wait excluded) of ``steps`` loop steps, the first 10 % dropped."""
    log = None
    if pace != "none":
        path = os.path.join(tempfile.mkdtemp(prefix="log_pace"), "log.sqlite")
        log = LogWriter(LogConfig(path=path, pace=pace))
        log.start_run({}, model="bench", device="cpu", version="bench")
    out = []
    for step in range(steps):
        t0 = time.perf_counter()
        host_work(80)
        if log is not None:
            log.nudge()
        w0 = time.perf_counter()
        device_wait(wait_us)
        waited = time.perf_counter() - w0
        host_work(40)
        reqs = [StepRequestRecord(f"r{i}", 300 + step, 6, 5, "11111", 6, 8) for i in range(batch)]
        rec = StepRecord(step, "decode", time.time(), batch, batch * 7, scorer="mqa_graph", policy="goodput",
                         proposer="ngram", plan_info=dict(PLAN_INFO), requests=reqs,
                         host_ms={"score": 0.6, "overlap": 0.2, "verify": 0.7, "other": 0.1})  # fmt: skip
        if log is not None:
            log.write_step(rec)
            if step % finish_every == 0:
                log.write_request(f"q{step}", client=None, arrival=0.0, first_token_time=0.0,
                                  finish_time=0.0, prompt_tokens=1, output_tokens=1, finish_reason=None,
                                  proposed=0, accepted=0)  # fmt: skip
        out.append((time.perf_counter() - t0 - waited) * 1e3)
    if log is not None:
        log.close()
    return out[steps // 10 :]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--wait-us", type=float, default=800.0)
    ap.add_argument("--finish-every", type=int, default=3)
    args = ap.parse_args(argv)
    modes = ["none", "record", "step"]
    got: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            got[m] += run(m, args.batch, args.steps, args.wait_us, args.finish_every)
    print(
        f"batch {args.batch}, {args.rounds} rounds of {args.steps} steps, device wait {args.wait_us:.0f} us"
    )
    print_modes("log.pace", "no log", got)


def print_modes(option: str, baseline: str, got: dict[str, list[float]]) -> None:
    """The table of host ms per step by mode of ``option``; the first mode is the baseline."""
    base = statistics.mean(next(iter(got.values())))
    print(f"| {option} | host ms / step, mean | median | p90 | mean − {baseline} |")
    print("|---|---|---|---|---|")
    for m, t in got.items():
        t = sorted(t)
        mean = statistics.mean(t)
        p50, p90 = statistics.median(t), t[int(0.9 * len(t))]
        print(f"| {m} | {mean:.3f} | {p50:.3f} | {p90:.3f} | {mean - base:+.3f} |")


if __name__ == "__main__":
    main()
