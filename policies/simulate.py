"""Run a policy for hundreds of decode steps on a modelled machine, on CPU, in well under a second.

The loop feeds the policy exactly as :class:`specsched.engine.engine.Engine` does: each step it
builds the :class:`BatchView` (context lengths, each request's ``max_k``, the
:class:`AcceptanceEstimator`'s mean and std, last k and accepted), calls ``decide(view, costs)``,
draws the acceptance walk, "measures" the step on the :class:`~specsched.policies.sim_machine.Machine`
(its noise-free cost times 1 + ``noise``·N(0, 1) per component), and hands a ``StepRecord`` to
``CostModels.observe``, the accepted counts to the estimator and to ``policy.observe``. Cost models
and estimator start fresh (the machine's device seeds) unless given.

Acceptance: whether a draft for output position m of a request is accepted (given every draft
before it was) is a Bernoulli(a) bit drawn once per position, so every policy run with the same
seed sees the same text (common random numbers), as a greedy draft model would. A request whose
position has no n-gram match (``match_prob``) has ``max_k = 0`` there. When one request finishes,
a fresh one (context ``prompt_len``) takes its slot, so the batch stays full.

Runs (``decode_steps`` S > 1): a plan that drafts nothing runs S plain forwards for one read and
one host overhead (:meth:`~specsched.policies.sim_machine.Machine.run_times`), each request keeping
its tokens up to its end, and the record says so as the engine's does (``num_decode_steps``; the
next drafting step's ``is_after_run``, here after runs only). A draft model lags by the tokens of
the steps it skipped; a drafting step whose requests lag by more than the machine's ``catchup_q``
pays its eager catch-up. ``num_steps`` counts decides (a run is one).

Score: ``goodput`` = Σ_steps Σ_i E(a_i, k_i) / Σ_steps T (expected tokens per ms, E from the true
a_i, T the noise-free step time), after ``warmup_steps`` that the policy learns from but that are
not scored. ``python -m specsched.policies.simulate --help`` compares policies with the fixed grid.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specsched.engine.records import StepRecord, StepRequestRecord
from specsched.policies.acceptance import AcceptanceEstimator, expected_tokens
from specsched.policies.base import BatchView, Policy, RequestView
from specsched.policies.cost_model import CostModels
from specsched.policies.fixed import FixedConfig, FixedPolicy
from specsched.policies.sim_machine import MACHINES, Machine, get_machine

__all__ = ["Scenario", "SimResult", "compare", "fixed_grid", "simulate"]


@dataclass
class Scenario:
    machine: Machine
    acceptance: float | list[float]  # per-token acceptance a, or one per batch slot
    batch: int = 1
    proposer: str = "synthetic"  # the proposer label the view and cost models see
    max_k: int = 8  # the engine's spec.max_k
    prompt_len: int = 128
    output_len: int = 96  # tokens per request; a finished request's slot gets a new one
    num_steps: int = 300  # scored steps
    warmup_steps: int = 0  # steps learned from but not scored (the bench's warm-up generate)
    match_prob: float = 1.0  # chance a position has an n-gram match (else max_k = 0 there)
    noise: float = 0.03  # relative std of each measured component
    scorers: list[str] | None = None  # scorers built (None: every scorer of the machine)
    shift: tuple[int, Machine] | None = None  # (step, machine): from that step on, steps cost its ms
    decode_steps: int = 1  # scheduler.decode_steps: a plan that drafts nothing runs this many steps

    def __post_init__(self) -> None:
        rates = self.acceptance if isinstance(self.acceptance, list) else [self.acceptance]
        if not rates or any(not 0.0 <= a <= 1.0 for a in rates):
            raise ValueError(f"scenario acceptance must be in [0, 1], got {self.acceptance}")
        for name in ("batch", "output_len", "num_steps", "decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"scenario {name} must be >= 1, got {getattr(self, name)}")
        if self.max_k < 0 or self.warmup_steps < 0 or self.prompt_len < 1:
            raise ValueError("scenario max_k and warmup_steps must be >= 0, prompt_len >= 1")
        if not 0.0 <= self.match_prob <= 1.0 or self.noise < 0:
            raise ValueError(f"scenario match_prob must be in [0, 1] and noise >= 0, got {self}")
        unknown = [s for s in self.scorers or [] if s not in self.machine.scorers]
        if unknown:
            raise ValueError(f"scenario scorers {unknown} not on machine {self.machine.name!r}")
        if self.shift is not None and any(s not in self.shift[1].scorers for s in self.scorer_names):
            raise ValueError(
                f"scenario shift machine {self.shift[1].name!r} lacks scorers {self.scorer_names}"
            )

    @property
    def scorer_names(self) -> list[str]:
        return list(self.scorers or self.machine.scorers)

    def rate(self, slot: int) -> float:
        return (
            self.acceptance[slot % len(self.acceptance)]
            if isinstance(self.acceptance, list)
            else self.acceptance
        )


@dataclass
class SimResult:
    label: str
    num_steps: int = 0
    expected_tokens: float = 0.0  # Σ E(a_i, k_i) with the true a_i
    emitted_tokens: int = 0  # as drawn
    time_ms: float = 0.0  # noise-free step time, summed
    num_drafts: int = 0
    num_request_steps: int = 0
    scorer_steps: Counter = field(default_factory=Counter)
    abs_prediction_error_ms: float = 0.0  # Σ |plan.predicted_ms - noise-free step ms|
    decide_ms: list[float] = field(default_factory=list)  # wall ms of each decide call

    @property
    def goodput(self) -> float:
        """Expected tokens per ms over the scored steps."""
        return self.expected_tokens / self.time_ms if self.time_ms else 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.goodput

    @property
    def mean_k(self) -> float:
        return self.num_drafts / self.num_request_steps if self.num_request_steps else 0.0

    @property
    def mean_prediction_error(self) -> float:
        """Mean |predicted − true| step ms relative to the mean true step ms."""
        return self.abs_prediction_error_ms / self.time_ms if self.time_ms else 0.0


class _SimRequest:
    def __init__(self, rid: str, a: float, sc: Scenario, rng: np.random.Generator) -> None:
        n = sc.output_len + sc.max_k + 2
        self.request_id, self.a, self.ctx, self.num_generated = rid, a, sc.prompt_len, 0
        self.bits = rng.random(n) < a  # [n] is a draft for output position m accepted
        self.match = rng.random(n) < sc.match_prob  # [n] does position m have an n-gram match
        self.last_k = self.last_accepted = 0
        self.pending = sc.prompt_len  # tokens the draft model has not seen yet (catch-up)


def simulate(
    policy: Policy,
    scenario: Scenario,
    seed: int = 0,
    costs: CostModels | None = None,
    estimator: AcceptanceEstimator | None = None,
    label: str | None = None,
    on_step: Callable[[int, BatchView, object, StepRecord], None] | None = None,
) -> SimResult:
    """Run ``policy`` on ``scenario`` (see module); ``on_step(step, view, plan, record)`` sees each step."""
    sc, m = scenario, scenario.machine
    costs = costs if costs is not None else CostModels(m.graph_buckets, device=m.device)
    estimator = estimator if estimator is not None else AcceptanceEstimator()
    bit_rng, noise_rng = np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])
    scorers, num_started = sc.scorer_names, 0

    def start(slot: int) -> _SimRequest:
        nonlocal num_started
        num_started += 1
        return _SimRequest(f"req-{num_started - 1}", sc.rate(slot), sc, bit_rng)

    slots = [start(i) for i in range(sc.batch)]
    is_after_run = False  # the last step was a run of plain steps (a draft model skipped its tokens)
    out = SimResult(label or getattr(policy, "name", type(policy).__name__))
    for step in range(sc.warmup_steps + sc.num_steps):
        views = []
        for r in slots:
            cap = min(sc.max_k, sc.output_len - r.num_generated - 1) if r.match[r.num_generated] else 0
            mean, std = estimator.mean_std(r.request_id, sc.proposer)
            views.append(RequestView(r.request_id, r.ctx, sc.proposer, max(cap, 0), mean, std,
                                     r.last_k, r.last_accepted))  # fmt: skip
        # a run is on offer when every request's proposer has drafts (engine/multi_step.py: a lack of
        # drafts is no choice); requests near their end do not cut it (their tokens past it are dropped)
        is_offer = all(r.match[r.num_generated] for r in slots)
        run = sc.decode_steps if sc.decode_steps > 1 and is_offer else 1
        view = BatchView(views, num_free_blocks=1 << 30, block_size=16, scorers=scorers, step=step,
                         decode_steps=run)  # fmt: skip
        t0 = time.perf_counter()
        plan = policy.decide(view, costs)
        decide_ms = (time.perf_counter() - t0) * 1e3
        if len(plan.k) != len(slots) or plan.scorer not in scorers:
            raise ValueError(f"policy {out.label!r} returned a plan that does not fit the batch: {plan}")
        k = np.minimum(np.asarray(plan.k, dtype=np.int64), [v.max_k for v in views])
        steps = run if not k.any() else 1  # the engine runs a plan that drafts nothing as the run
        accepted = []
        for r, ki in zip(slots, k.tolist(), strict=True):
            walk = r.bits[r.num_generated : r.num_generated + ki]
            accepted.append(int(np.argmin(walk)) if not walk.all() else ki)
        on = sc.shift[1] if sc.shift is not None and step >= sc.shift[0] else m
        ctx = np.array([r.ctx for r in slots])
        if steps > 1:
            true = on.run_times(plan.scorer, ctx, steps)
        else:
            lag = on.catchup_q
            behind = sum(ki > 0 and r.pending > lag for r, ki in zip(slots, k.tolist(), strict=True))
            true = on.step_times(plan.scorer, k, ctx, behind > 0, behind)
        meas = true.noisy(noise_rng, sc.noise)
        rec = StepRecord(
            step, "decode", 0.0, len(slots), int(k.sum()) + len(slots) * steps, scorer=plan.scorer,
            policy=out.label, proposer=sc.proposer, propose_ms=meas.propose_ms, score_ms=meas.score_ms,
            verify_ms=meas.verify_ms, total_ms=meas.total_ms,
            requests=[StepRequestRecord(r.request_id, r.ctx - 1, ki, n)
                      for r, ki, n in zip(slots, k.tolist(), accepted, strict=True)],
        )  # fmt: skip
        # flagged after runs only: the engine flags a step after a single plain step too, but the
        # presets' catch-up (catchup_q 1) is folded into their fitted propose costs, and the traces of
        # tests/policies/test_fast_paths.py were recorded without such flags
        rec.num_decode_steps = steps
        rec.is_after_run = is_after_run and (steps > 1 or bool(k.any()))
        is_after_run = steps > 1
        costs.observe(rec)
        if step >= sc.warmup_steps:
            out.num_steps += 1
            if steps > 1:  # each request keeps the run's tokens up to its end
                kept = sum(min(steps, sc.output_len - r.num_generated) for r in slots)
                out.expected_tokens, out.emitted_tokens = (
                    out.expected_tokens + kept,
                    out.emitted_tokens + kept,
                )
            else:
                out.expected_tokens += sum(
                    expected_tokens(r.a, ki) for r, ki in zip(slots, k.tolist(), strict=True)
                )
                out.emitted_tokens += sum(accepted) + len(slots)
            out.time_ms += true.total_ms
            out.num_drafts += int(k.sum())
            out.num_request_steps += len(slots)
            out.scorer_steps[plan.scorer] += 1
            out.decide_ms.append(decide_ms)
            if plan.predicted_ms is not None:
                out.abs_prediction_error_ms += abs(plan.predicted_ms - true.total_ms)
        if on_step is not None:
            on_step(step, view, plan, rec)
        for i, (r, ki, n) in enumerate(zip(slots, k.tolist(), accepted, strict=True)):
            estimator.observe(r.request_id, sc.proposer, ki, n)
            emitted = n + 1 if steps == 1 else min(steps, sc.output_len - r.num_generated)
            r.pending = (2 if n == ki else 1) if ki > 0 else r.pending + emitted
            r.num_generated += emitted
            r.ctx += emitted
            r.last_k, r.last_accepted = ki, n
            if r.num_generated >= sc.output_len:
                estimator.forget(r.request_id)
                slots[i] = start(i)
        policy.observe(plan, accepted)
    return out


def fixed_grid(
    scenario: Scenario, ks: list[int] | None = None, scorers: list[str] | None = None, seed: int = 0
) -> dict[str, SimResult]:
    """``fixed`` at each k (default 0..max_k) × scorer (default every scorer of the scenario)."""
    out = {}
    for s in scorers or scenario.scorer_names:
        for k in range(scenario.max_k + 1) if ks is None else ks:
            label = f"fixed k={k} {s}"
            out[label] = simulate(FixedPolicy(FixedConfig(k=k, scorer=s)), scenario, seed, label=label)
    return out


def compare(
    scenario: Scenario, policies: dict[str, Callable[[], Policy]], seed: int = 0
) -> tuple[dict[str, SimResult], SimResult, SimResult]:
    """(the policies' results, the best fixed (k >= 1, scorer) result, the k = 0 result)."""
    grid = fixed_grid(scenario, seed=seed)
    k0 = max((r for label, r in grid.items() if label.startswith("fixed k=0 ")), key=lambda r: r.goodput)
    best = max(
        (r for label, r in grid.items() if not label.startswith("fixed k=0 ")), key=lambda r: r.goodput
    )
    return {name: simulate(make(), scenario, seed, label=name) for name, make in policies.items()}, best, k0


def main(argv: list[str] | None = None) -> None:
    from specsched.policies.registry import POLICIES, build_policy

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--machine", nargs="+", default=list(MACHINES), choices=list(MACHINES))
    p.add_argument("--acceptance", nargs="+", type=float, default=[0.3, 0.6, 0.9])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=0, help="steps learned from but not scored")
    p.add_argument("--decode-steps", type=int, default=1, help="scheduler.decode_steps (runs of plain steps)")
    p.add_argument("--policy", nargs="+", default=["goodput"], choices=sorted(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    header = ["machine", "a", "batch", "policy", "tok/s", "mean k", "scorers", "best fixed", "tok/s",
              "vs best", "k=0 tok/s", "decide ms p50"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|---" * 12 + "|")
    for name in args.machine:
        machine = get_machine(name)
        proposer = "ngram" if "smollm2" in name else "synthetic"
        for a in args.acceptance:
            for b in args.batch:
                sc = Scenario(machine, a, b, proposer, num_steps=args.steps, warmup_steps=args.warmup,
                              decode_steps=args.decode_steps)  # fmt: skip
                makers = {n: (lambda n=n: build_policy({"name": n})) for n in args.policy}
                results, best, k0 = compare(sc, makers, args.seed)
                for r in results.values():
                    mix = ", ".join(f"{s} {c}" for s, c in r.scorer_steps.most_common())
                    print(f"| {name} | {a} | {b} | {r.label} | {r.tokens_per_s:.1f} | {r.mean_k:.2f} | {mix} "
                          f"| {best.label} | {best.tokens_per_s:.1f} | {r.goodput / best.goodput:.3f} "
                          f"| {k0.tokens_per_s:.1f} | {np.median(r.decide_ms):.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
