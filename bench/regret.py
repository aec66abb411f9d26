"""``bench=regret`` (issue 13): does the per-step choice beat every static setting, by more than the
spread between runs?

A *cell* is one workload: a batch size with synthetic acceptance a on the 7B pair, or a real model
with one proposer on real prompts. In each cell every *config* runs — non-speculative, the fixed
(k, scorer) grid and each built-in policy (:func:`specsched.bench.e2e.policy_configs`) — ``repeats``
times, *interleaved*: repeat r runs every config once, in an order shuffled per repeat with a seed,
before repeat r + 1, so that drift of the machine (clocks, temperature, other tenants) hits all
configs alike and ratios within one repeat are paired.

*Warm-up*, outside every timed window and the same for every config: a profile run over the cell's
prompts cycles k in {0, fixed k, max k} x every scorer step by step (compiles, graph warm-up, and
cost models and acceptance estimates fitted on every scorer); then every config runs one short
untimed generate. Each timed window starts from a copy of the profiled cost models and acceptance
estimator, with a fresh engine and policy, and runs whole passes over the cell's prompts (so every
config sees the same mix of prompts) until it took at least ``min_steps`` decode steps (forwards: a
run of S plain steps, ``scheduler.decode_steps``, counts S; counted as records, a config that runs
them took S times the tokens, and the grid with runs of 4 no longer fit a 540 s call), or the
batch's own ``min_steps_by_batch`` (a step at batch 64 carries 64 requests' tokens: fewer steps
time it as well, and the full grid at 500 steps a window is ~40 min of an H200). With ``refill``
a window instead keeps the batch full, each finished request replaced by the next prompt (cycled),
and times the tokens emitted until ``min_steps``
(:func:`~specsched.bench.regret_windows.refilled_window`): closed groups of equal-length requests
finish together without speculation and spread out with it, so their drain charges speculation for
the benchmark's shape, not for its steps. The windows: :mod:`specsched.bench.regret_windows`.

Per cell: the *oracle* is the config other than goodput with the best median tok/s; goodput's ratio
to it and to non-speculative per repeat (median and min-max over repeats); goodput's ``decide`` ms
(p50/p99 over the steps that decided, from ``plan_info.decide_ms``: a plan carried over by the
engine's decide budget costs its step nothing, ``decides_per_step`` says how often it decided); and
the cost models' held-out score-ms error per scorer (:func:`specsched.policies.cost_error.held_out_error`
over the cell's timed steps), and beside it each step's error predicted before it was learnt, in one
pass with the engine's forgetting (:func:`specsched.policies.cost_error.prequential_error`: what the
policy met live; it follows a drift of the host that the fit-then-hold-out split does not).
"""

from __future__ import annotations

import gc
import logging
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, replace

import torch

from specsched.bench.common import make_engine
from specsched.bench.e2e import use_draft_loop
from specsched.bench.regret_cells import NON_SPEC, Cell, real_cells, synthetic_cells
from specsched.bench.regret_report import regret_markdown
from specsched.bench.regret_windows import Sample, closed_window, run_window, write_window_log
from specsched.engine.heap import freeze_heap
from specsched.engine.records import StepRecord
from specsched.policies.base import BatchView, Plan, Policy
from specsched.policies.cost_error import held_out_error, prequential_error
from specsched.policies.fixed import capped_k
from specsched.scorers.graph import graph_buckets_of

logger = logging.getLogger(__name__)
__all__ = ["NON_SPEC", "Cell", "Sample", "regret_markdown", "run_regret", "summarize"]


class ProfilePolicy(Policy):
    """Warm-up only: steps take the (k, scorer) pairs of the grid round robin, each for ``hold``
    steps in a row (``bench.regret.profile_hold``; 1: a new pair every step). Held, each pair's
    steps after the first run as a fixed config's do, on the graph the step before ran (the H100 cell
    of 2026-12-06 10:23, batch 4 a = 0.3: the round robin's steps on the 8-row expansion graph took
    6.35 ms, fixed k = 1's on it 6.02; whether the switching is why is what a held profile tells)."""

    name = "profile"

    def __init__(self, ks: list[int], scorers: list[str], hold: int = 1) -> None:
        if hold < 1:
            raise ValueError(f"bench.regret.profile_hold must be >= 1, got {hold}")
        self.grid, self.num, self.hold = [(k, s) for k in ks for s in scorers], 0, hold

    def decide(self, view: BatchView, costs) -> Plan:
        k, s = self.grid[(self.num // self.hold) % len(self.grid)]
        self.num += 1
        return Plan(capped_k(view, k), s if s in view.scorers else view.scorers[0], self.name)


def profile_state(cell: Cell, cfg):
    """The shared warm-up: (cost models, acceptance estimator) after >= ``cfg.warmup_steps`` decode
    steps over the cell's prompts that cycle k in {0, fixed k, max k} x every scorer (each pair for
    ``cfg.profile_hold`` steps: :class:`ProfilePolicy`), run twice: the
    first run compiles and warms caches (its cold steps, up to 100x slow, would skew the fit), the
    second fits fresh cost models."""
    ks = sorted({0, *cfg.fixed_k, cell.spec.max_k})
    run = cell.runs[-1]  # a config of the cell's proposer: its proposer set and default
    use_draft_loop(replace(run, draft_loop=False))  # profiled on a replay a draft step, as by default
    hold = cfg.get("profile_hold")
    hold = 1 if hold is None else int(hold)  # an older config has none: the round robin
    make = lambda: make_engine(
        cell.spec, run.proposers, run.proposer, ProfilePolicy(ks, list(cell.spec.scorers), hold)
    )
    engine = make()
    closed_window(engine, cell, cfg.warmup_steps)
    fresh = make()
    fresh.acceptance = engine.acceptance
    closed_window(fresh, cell, cfg.warmup_steps)
    return fresh.costs, fresh.acceptance


def run_cell(cell: Cell, cfg, seed: int) -> dict:
    """Every config of ``cell`` ``cfg.repeats`` times, interleaved (see module); the cell's summary."""
    state = profile_state(cell, cfg)
    for run in cell.runs if cfg.compile_tokens else []:  # each config's own shapes compile, untimed
        run_window(run, state, cell, 0, cfg.compile_tokens)
    log_dir = cfg.get("log_dir")
    samples: list[Sample] = []
    records: list[StepRecord] = []
    try:
        for r in range(cfg.repeats):
            order = list(cell.runs)
            random.Random(seed * 1000 + r).shuffle(order)
            for run in order:
                # as the daemon after its start-up: what is alive now (the model, every record kept so
                # far) leaves the collector's full passes, which would otherwise grow with the records
                # and stall a window's step (H100, 2026-12-05: 233 ms in one of goodput's steps)
                freeze_heap()
                fields, recs, steps = run_window(
                    run, state, cell, min_steps_of(cfg, cell.batch), refill=bool(cfg.get("refill")),
                    stagger=bool(cfg.get("stagger")),
                )  # fmt: skip
                if log_dir:
                    write_window_log(log_dir, cell, run, r, steps, state[0], fields["num_compiles"])
                samples.append(Sample(run.label, r, **fields))
                records += recs
                logger.info("regret %s batch %d repeat %d %s: %.1f tok/s (%d steps, %d compiles, %d full "
                            "collections)", cell.proposer, cell.batch, r, run.label, fields["tokens_per_s"],
                            fields["num_steps"], fields["num_compiles"], fields["num_full_gc"])  # fmt: skip
    finally:
        gc.unfreeze()  # the cell's garbage may go once its windows are done (or one failed)
    device = "cuda" if cell.spec.model.lm_head.weight.device.type == "cuda" else "cpu"
    buckets = graph_buckets_of(cell.spec.scorers)
    errors = held_out_error(records, device=device, graph_buckets=buckets)
    live = prequential_error(records, device=device, graph_buckets=buckets)
    out = summarize(samples, [r.label for r in cell.runs])
    out.update(suite=cell.suite, model=cell.spec.name, proposer=cell.proposer, batch=cell.batch,
               acceptance=cell.acceptance, samples=[asdict(s) for s in samples],
               cost_error=[{**asdict(e), "live_median": live.get((e.scorer, e.batch_size))}
                           for e in errors])  # fmt: skip
    return out


def min_steps_of(cfg, batch: int) -> int:
    """The decode steps a window of a cell at ``batch`` takes at least: ``min_steps_by_batch[batch]``
    where given, else ``min_steps``."""
    by = cfg.get("min_steps_by_batch") or {}
    found = by.get(batch, by.get(str(batch)))  # a key written as a string counts too
    steps = cfg.min_steps if found is None else int(found)
    if steps < 0:
        raise ValueError(f"bench.regret.min_steps_by_batch[{batch}] must be >= 0, got {steps}")
    return steps


def is_goodput(label: str) -> bool:
    return label == "policy goodput" or label.startswith("policy goodput (")


def _median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _median_dict(dicts: list[dict | None]) -> dict | None:
    """Key by key, the median over the repeats that have the dict and a value for the key."""
    known = [d for d in dicts if d]
    if not known:
        return None
    keys = dict.fromkeys(k for d in known for k in d)  # a key None in a repeat: the others' median
    return {
        k: statistics.median(xs) if (xs := [d[k] for d in known if d.get(k) is not None]) else None
        for k in keys
    }


def summarize(samples: list[Sample], labels: list[str]) -> dict:
    """Per config: median and min-max tok/s over repeats; the oracle (best median but goodput);
    goodput's per-repeat ratios to the oracle and to non-speculative (median, min, max)."""
    by = {
        label: sorted((s for s in samples if s.config == label), key=lambda s: s.repeat) for label in labels
    }
    configs = {
        label: dict(
            tokens_per_s=statistics.median(s.tokens_per_s for s in ss),
            min=min(s.tokens_per_s for s in ss),
            max=max(s.tokens_per_s for s in ss),
            min_steps=min(s.num_steps for s in ss),
            mean_k=statistics.median(s.mean_k for s in ss),
            num_compiles=sum(s.num_compiles for s in ss),
            num_full_gc=sum(s.num_full_gc for s in ss),
            step_ms=_median_dict([s.step_ms for s in ss]),
            young_gc_per_step=_median([s.young_gc_per_step for s in ss]),
        )  # fmt: skip
        for label, ss in by.items()
    }
    out: dict = {"configs": configs, "oracle": None, "goodput": None}
    others = [label for label in labels if not is_goodput(label)]
    out["oracle"] = max(others, key=lambda x: configs[x]["tokens_per_s"]) if others else None
    good = next((label for label in labels if is_goodput(label)), None)
    if good is None or out["oracle"] is None:
        return out
    out["goodput"] = good

    def ratio(other: str) -> dict | None:
        if other not in by:
            return None
        rs = [g.tokens_per_s / o.tokens_per_s for g, o in zip(by[good], by[other], strict=True)]
        return {"median": statistics.median(rs), "min": min(rs), "max": max(rs), "per_repeat": rs}

    out["vs_oracle"], out["vs_non_spec"] = ratio(out["oracle"]), ratio(NON_SPEC)
    # goodput against its variants (policies "goodput@tag"), paired per repeat: an A/B in the cell
    out["vs_variants"] = {v: ratio(v) for v in labels if is_goodput(v) and v != good}
    ps = [s.decide_ms_p99 for s in by[good] if s.decide_ms_p99 is not None]
    out["decide_ms_p99"] = max(ps) if ps else None
    return out


def run_regret(
    cfg,
    graphs_cfg,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    seed: int,
    on_cell: Callable[[dict], None] | None = None,
) -> dict:
    """``bench.regret``: every cell of the enabled suites; the tables in ``markdown``. ``on_cell`` gets
    the results so far after each cell (the CLI writes them out: a device call cut at its time limit
    still returns the cells it finished)."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True)
    common = {k: v for k, v in plain.items() if k not in ("synthetic", "real")}
    cells, errors = [], {}
    by_batch = {int(b): int(n) for b, n in (plain.get("min_steps_by_batch") or {}).items()}

    def results() -> dict:
        out = {
            "cells": list(cells),
            "repeats": cfg.repeats,
            "min_steps": cfg.min_steps,
            "errors": dict(errors),
            "min_steps_by_batch": by_batch,
            "refill": bool(plain.get("refill")),
            "stagger": bool(plain.get("refill") and plain.get("stagger")),
            "profile_hold": int(plain.get("profile_hold") or 1),
        }
        out["markdown"] = regret_markdown(out)
        return out

    for suite, make in (("synthetic", synthetic_cells), ("real", real_cells)):
        sub = OmegaConf.merge(OmegaConf.create(common), OmegaConf.create(plain[suite]))  # shared keys too
        try:  # a failing suite (a model missing) keeps the other's cells
            for cell in make(sub, graphs_cfg, device, dtype, block_size, seed) if sub.enabled else []:
                cell.spec.scheduler = dict(plain.get("scheduler") or {})  # every window's engine
                cells.append(run_cell(cell, sub, seed))
                if on_cell is not None:
                    on_cell(results())
        except Exception as e:
            logger.exception("regret suite %s failed", suite)
            errors[suite] = f"{type(e).__name__}: {e}"[:300]
    return results()
