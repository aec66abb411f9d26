"""The timed windows of ``bench=regret`` (:mod:`specsched.bench.regret` runs and summarizes them): a
fresh engine per config from the cell's profiled cost models and acceptance, run until its decode
forwards reach the window's minimum, and one :class:`Sample` of it.

Two shapes of window: :func:`closed_window`, whole passes over the cell's prompts in closed groups of
the batch size (every request of a group has the same length), and :func:`refilled_window`
(``bench.regret.refill``), the batch kept full, each finished request replaced at once by the next
prompt, as the daemon serves. Each window counts the Triton variants built and the collector's full
passes inside it (a stall each), and can be written as one run of the cell's decision log
(:func:`write_window_log`).
"""

from __future__ import annotations

import copy
import gc
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path

import numpy as np

from specsched.bench.common import make_engine, scheduler_config, sync
from specsched.bench.e2e import RunConfig, use_draft_loop
from specsched.bench.regret_cells import Cell
from specsched.bench.serve_clients import stagger_plan
from specsched.engine.records import StepRecord
from specsched.engine.request import Request, SamplingParams
from specsched.kernels.compile_watch import compile_watch

__all__ = ["Sample", "closed_window", "refilled_window", "run_window", "write_window_log"]
STEP_FIELDS = (("step", "total_ms"), ("propose", "propose_ms"), ("score", "score_ms"))  # Sample.step_ms


@dataclass
class Sample:
    config: str
    repeat: int
    tokens_per_s: float
    num_steps: int  # decode steps in the window (forwards: a run of S plain steps counts S)
    num_passes: float  # passes over the cell's prompts (a refilled window: prompts admitted / prompts)
    mean_k: float
    decide_ms_p50: float | None
    decide_ms_p99: float | None
    scorer_steps: dict = field(default_factory=dict)
    decides_per_step: float | None = None  # steps that decided / decode steps (carried plans: none)
    num_compiles: int = 0  # Triton variants built inside the timed window (a stall each; want 0)
    num_full_gc: int = 0  # the collector's full (generation 2) passes inside the window
    # median ms of the window's decode records: the step (host wall), its draft and its scoring (the
    # device's when timed by events); which part of a gap between configs of the same choices is whose
    step_ms: dict | None = None  # {"step", "propose", "score", "propose_host", ...}: step_phases
    young_gc_per_step: float | None = None  # the collector's generation 0 and 1 passes / decode record


def run_window(
    run: RunConfig,
    state,
    cell: Cell,
    min_steps: int,
    tokens: int | None = None,
    refill: bool = False,
    stagger: bool = False,
):
    """A fresh engine and policy from a copy of the profiled ``state`` (cost models, acceptance),
    whole passes over the cell's prompts until ``min_steps`` decode steps (one pass when
    ``tokens`` cuts each request short; ``refill``: :func:`refilled_window` instead, its first
    requests cut short by ``stagger``): (the :class:`Sample` fields, the decode records, every
    step's record)."""
    use_draft_loop(run)
    engine = make_engine(cell.spec, run.proposers, run.proposer, run.make_policy(), run.scheduler)
    engine.costs, engine.acceptance = copy.deepcopy(state[0]), copy.deepcopy(state[1])
    if refill and tokens is None:
        return refilled_window(engine, cell, min_steps, stagger)
    return closed_window(engine, cell, min_steps, tokens)


def engine_settings(cell: Cell, run: RunConfig) -> dict:
    """The window's engine as the replay reads a run's config (policies/replay_log.py RunSettings):
    proposer, max k and scorers (``spec``), batch bound, cache blocks and the policy's options."""
    policy = run.make_policy()
    options = getattr(policy, "config", None)
    spec = cell.spec
    return {
        "spec": {"proposer": run.proposer, "max_k": spec.max_k, "scorers": list(spec.scorers)},
        # the engine's whole scheduler (its run options included: the replay runs plain steps by them)
        "scheduler": asdict(scheduler_config(spec, run.scheduler)),
        "cache": {"block_size": spec.block_size, "num_blocks": spec.num_blocks},
        "policy": {"name": policy.name, **(asdict(options) if is_dataclass(options) else {})},
    }


def write_window_log(
    log_dir: str,
    cell: Cell,
    run: RunConfig,
    repeat: int,
    steps: list[StepRecord],
    costs,
    num_compiles: int = 0,
) -> str:
    """One timed window as one run of the cell's decision log (``<log_dir>/<cell>_b<batch>.sqlite``,
    e.g. ``real_ngram_b1``; written after the window, outside its timing): every step, prefills too,
    and the cost models the window started from (``cost_models``), for specsched-replay and
    bench/plan_gap.py. ``runs.config`` names the cell, the config and the repeat, and holds the
    engine's settings (:func:`engine_settings`), ``num_compiles`` the Triton variants built inside the
    window (the run row's ``num_compiles_after_start``). Returns the path."""
    from specsched.bench.e2e import open_run_log, run_identity

    what = cell.proposer if cell.proposer.startswith(cell.suite) else f"{cell.suite} {cell.proposer}"
    name = re.sub(r"[^A-Za-z0-9.]+", "_", f"{what} b{cell.batch}").strip("_")
    path = str(Path(log_dir) / f"{name}.sqlite")
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    identity = run_identity("regret", cell.spec, cell.batch, cell.proposer, cell.acceptance, run.label)
    device = str(cell.spec.model.lm_head.weight.device)
    log = open_run_log(
        path, {**identity, "repeat": repeat, **engine_settings(cell, run)}, cell.spec.name, device
    )
    try:
        log.save_costs(costs)
        for rec in steps:
            log.write_step(rec)
        log.end_run(num_compiles)
    finally:
        log.close()
    return path


class _Window:
    """What a timed window records (its engine's ``on_step``) and counts: the decode records, every
    step's record (prefills too, for the decision log), the decode forwards (a run of S plain steps,
    ``scheduler.decode_steps``, is S of them), and the Triton builds and full collections since it
    was made."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.steps: list[StepRecord] = []
        self.num_forwards = 0
        self.watch = compile_watch()
        self.watch.install()
        self.built0, self.full_gc0 = self.watch.num_built, gc.get_stats()[2]["collections"]
        self.young_gc0 = _young_collections()

    def __call__(self, rec: StepRecord) -> None:
        self.steps.append(rec)
        if rec.kind == "decode":
            self.records.append(rec)
            self.num_forwards += rec.num_decode_steps

    def fields(self, num_tokens: int, wall: float, passes: float) -> dict:
        """The :class:`Sample` fields of the window."""
        records = self.records
        decide = [r.plan_info["decide_ms"] for r in records  # the steps that decided (plan_age 0)
                  if "decide_ms" in r.plan_info and not r.plan_info.get("plan_age")]  # fmt: skip
        request_steps = sum(r.batch_size for r in records)
        return dict(
            tokens_per_s=num_tokens / wall, num_steps=self.num_forwards, num_passes=passes,
            mean_k=sum(r.num_proposed for r in records) / max(request_steps, 1),
            decide_ms_p50=float(np.percentile(decide, 50)) if decide else None,
            decide_ms_p99=float(np.percentile(decide, 99)) if decide else None,
            scorer_steps=dict(Counter(r.scorer for r in records)),
            decides_per_step=len(decide) / len(records) if records else None,
            num_compiles=self.watch.num_built - self.built0,
            num_full_gc=gc.get_stats()[2]["collections"] - self.full_gc0,
            step_ms=step_phases(records) if records else None,
            young_gc_per_step=(_young_collections() - self.young_gc0) / len(records) if records else None,
        )  # fmt: skip


def step_phases(records: list[StepRecord]) -> dict:
    """Medians of the decode ``records``' phases (:data:`STEP_FIELDS`), and of ``propose`` three ways:
    its host (Python) ms alone (``propose_host``: the draft loop's launches, whatever the device did),
    and its ms on the steps that ran a plan decided ahead for them (``propose_fresh``: the step after
    a decide ahead) and on those that ran a held plan again (``propose_carried``); None where the
    window has no such step. A gap between two configs of the same choices that sits in ``propose``
    is the host's when ``propose_host`` moves with it, and follows the decides ahead when
    ``propose_fresh`` stands above ``propose_carried`` (H100, 2026-12-07 09:27: goodput at batch 4,
    a = 0.9, +0.24-0.41 ms a step against fixed k = 8, found in the logs)."""
    out = {name: float(np.median([getattr(r, f) for r in records])) for name, f in STEP_FIELDS}
    fresh = [
        r.propose_ms
        for r in records
        if r.plan_info.get("is_planned_ahead") and not r.plan_info.get("plan_age")
    ]
    carried = [r.propose_ms for r in records if r.plan_info.get("plan_age")]
    host = [r.host_ms["propose"] for r in records if "propose" in (r.host_ms or {})]
    for name, xs in (("propose_host", host), ("propose_fresh", fresh), ("propose_carried", carried)):
        out[name] = float(np.median(xs)) if xs else None
    return out


def _young_collections() -> int:
    stats = gc.get_stats()
    return stats[0]["collections"] + stats[1]["collections"]


def closed_window(engine, cell: Cell, min_steps: int, tokens: int | None = None):
    window = _Window()
    engine.on_step = window
    groups = [cell.prompts[i : i + cell.batch] for i in range(0, len(cell.prompts), cell.batch)]
    params = SamplingParams(max_tokens=tokens or cell.max_new_tokens, ignore_eos=True)
    device = cell.spec.model.lm_head.weight.device
    num_tokens = passes = 0
    sync(device)
    t0 = time.perf_counter()
    while not passes or (window.num_forwards < min_steps and tokens is None):
        for group in groups:
            num_tokens += sum(map(len, engine.generate(group, params)))
        passes += 1
    sync(device)
    wall = time.perf_counter() - t0
    engine.flush_observations()
    engine.on_step = None
    return window.fields(num_tokens, wall, passes), window.records, window.steps


def refilled_window(engine, cell: Cell, min_steps: int, stagger: bool = False):
    """A window at a steady batch: ``cell.batch`` requests in flight from the start, each finished one
    replaced at once by the next prompt of the cell's list (cycled), until ``min_steps`` decode
    forwards; tok/s = tokens emitted in the window / its wall time. The requests still running at
    its end finish outside it, untimed and unrecorded. As the daemon serves (a finished request's
    slot goes to a waiting one), unlike :func:`closed_window`'s groups, where every request of a
    group has the same length: without speculation they all finish at one step, with it they spread
    out and the group's last steps run a draining batch (batch 64, a = 0.3, H100 2026-12-05: 155 and
    306 ms of goodput's 2.7 s windows, the whole of its deficit to non-speculative).

    ``stagger`` (``bench.regret.stagger``): the first ``cell.batch`` requests stop after
    :func:`~specsched.bench.serve_clients.stagger_plan` tokens (evenly spread up to a whole request,
    as ``bench=serve``'s clients start), so that requests finish and refill at a steady rate from
    the start, whatever the config. Without it the requests of a config that emits one token a step
    stay in step: they all finish at once and their refill is one batched prefill (one 16-prompt
    prefill of 40 ms on the 7B, H100 2026-12-06), while a speculative config's finish apart and
    refill in one- or two-prompt prefills (9 ms each on graphs, 23 of them in goodput's window at
    batch 16, a = 0.3) — a lockstep that a server whose requests differ in length never sees."""
    prompts, num_admitted = cell.prompts, [0]
    firsts = stagger_plan(cell.max_new_tokens, cell.batch) if stagger else []

    def admit() -> None:
        i = num_admitted[0]
        max_tokens = firsts[i] if i < len(firsts) else cell.max_new_tokens
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(Request(f"w-{i}", list(prompts[i % len(prompts)]), params))
        num_admitted[0] += 1

    device = cell.spec.model.lm_head.weight.device
    window = _Window()
    engine.on_step = window
    for _ in range(cell.batch):
        admit()
    num_tokens = 0
    sync(device)
    t0 = time.perf_counter()
    while window.num_forwards < min_steps:
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                admit()
    sync(device)
    wall = time.perf_counter() - t0
    engine.on_step = None
    while engine.has_unfinished:  # outside the window
        engine.step()
    engine.flush_observations()
    return window.fields(num_tokens, wall, num_admitted[0] / len(prompts)), window.records, window.steps
