"""Modelled machines for :mod:`specsched.policies.simulate`: the "GPU" as a cost function.

A :class:`Machine` gives the ms of each step component (propose, score, verify, overhead) from a
step's shape, the way the engine measures them, so a policy and its online cost models can be run
for hundreds of steps on CPU in a fraction of a second. Presets (:data:`MACHINES`) carry
coefficients read off the 2026-12-02 H200 run in docs/benchmarks.md:

- ``h200-llama2-7b``: ``llama2-7b`` target with the ``llama-68m`` draft. Scoring, least squares over
  the scorer micro-benchmark (rel. error <= 11%): batch expansion (graph) 8.2 + 0.036 ms per padded
  row + 0.066 ms per row per 1k context tokens; MQA graph 8.2 + 0.023 ms per padded token + 0.07 ms
  per 1k context tokens; eager MQA ~25 ms. Host overhead 0.8 + 0.15 ms per request (the batch-1 and
  batch-16 non-speculative rows against their scoring times). A draft forward 0.9 ms (0.6 graph +
  host); a step whose draft model must catch up more than one token (a request accepted all its
  drafts last step, skipped a step, or is new) runs that forward eagerly: +2.5 ms. Both are fitted
  to the end-to-end rows at a = 0.6 and 0.9 (k = 1 and 3, MQA graph). (The engine's draft graphs
  take catch-ups of 2 tokens since 2026-12-05 and of 6 since 2026-12-06: ``catchup_q``; an eager
  catch-up's cost grows with its lagging rows, ``catchup_row_ms``: on the 2026-12-06 H100 log at
  batch 64, +1.7 ms for 3 new prompts, +7-10 ms for 64 requests after a run.)
- ``h200-smollm2-135m``: SmolLM2-135M with n-gram drafts: launch-bound, ~3 ms a step nearly flat in
  tokens; n-gram lookups cost ~0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specsched.policies.step_cost import StepCost

__all__ = ["MACHINES", "Machine", "ScorerCost", "StepTimes", "get_machine"]

LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)  # graph bucket sizes


@dataclass(frozen=True)
class ScorerCost:
    """ms of one scoring step: bias + row_ms·rows + token_ms·tokens + ctx_ms·Σctx_i/1e3 +
    row_ctx_ms·Σ(k_i+1)·ctx_i/1e3; graph scorers pad rows (expansion) or tokens (MQA) to ``buckets``
    and run eagerly above the largest (+ ``eager_ms``)."""

    bias_ms: float
    row_ms: float = 0.0
    token_ms: float = 0.0
    ctx_ms: float = 0.0
    row_ctx_ms: float = 0.0
    is_expansion: bool = False  # one row per scored token
    buckets: tuple[int, ...] | None = None  # captured sizes (None: an eager scorer)
    eager_ms: float = 0.0  # launch overhead of running a graph scorer's shape eagerly

    def __post_init__(self) -> None:
        if self.bias_ms < 0 or min(self.row_ms, self.token_ms, self.ctx_ms, self.row_ctx_ms) < 0:
            raise ValueError(f"scorer cost coefficients must be >= 0, got {self}")
        if self.buckets is not None and (not self.buckets or min(self.buckets) < 1):
            raise ValueError(f"buckets must be a non-empty tuple of sizes >= 1, got {self.buckets}")

    def ms(self, k: np.ndarray, ctx: np.ndarray) -> float:
        tokens = int(k.sum()) + len(k)
        rows = tokens if self.is_expansion else len(k)
        eager = 0.0
        if self.buckets is not None:  # rows == tokens under expansion; MQA buckets are keyed by tokens
            if tokens > self.buckets[-1]:
                eager = self.eager_ms
            else:
                tokens = next(b for b in self.buckets if b >= tokens)
                rows = tokens if self.is_expansion else rows
        row_ctx = float(((k + 1) * ctx).sum()) / 1e3
        return (
            self.bias_ms
            + self.row_ms * rows
            + self.token_ms * tokens
            + self.ctx_ms * float(ctx.sum()) / 1e3
            + self.row_ctx_ms * row_ctx
            + eager
        )


class StepTimes(StepCost):
    """One step's ms per component, as the engine's ``StepRecord`` holds them (the fields and
    ``total_ms`` of the cost models' :class:`~specsched.policies.step_cost.StepCost`)."""

    def noisy(self, rng: np.random.Generator, rel_std: float) -> StepTimes:
        """Measured times: each component times (1 + rel_std·N(0, 1)), at least 0."""
        f = np.maximum(1.0 + rel_std * rng.standard_normal(4), 0.0)
        return StepTimes(self.propose_ms * f[0], self.score_ms * f[1], self.verify_ms * f[2],
                         self.overhead_ms * f[3])  # fmt: skip


@dataclass(frozen=True)
class Machine:
    """A modelled GPU + host: ms per step component from the step's shape (see module)."""

    name: str
    scorers: dict[str, ScorerCost] = field(default_factory=dict)
    draft_bias_ms: float = 0.0  # per step that drafts at all
    draft_forward_ms: float = 0.0  # per sequential draft forward (a draft model runs max k of them)
    draft_row_ms: float = 0.0  # per drafting request per forward
    draft_token_ms: float = 0.0  # per draft token (n-gram lookup, sampling)
    catchup_ms: float = 0.0  # extra when a drafting request's draft model is > catchup_q tokens behind
    catchup_row_ms: float = 0.0  # ... plus this per such request (an eager forward's rows)
    # the longest catch-up the draft's graphs take (q_len): 1 as fitted on 2026-12-02 (every catch-up
    # of 2 tokens or more eager); the engine's draft graphs take 2 since 2026-12-05, 6 since 2026-12-06
    catchup_q: int = 1
    verify_bias_ms: float = 0.1
    verify_token_ms: float = 0.0
    overhead_ms: float = 0.5  # host: schedule, inputs, commit (not the policy's own decide)
    overhead_request_ms: float = 0.0
    device: str = "cuda"  # which CostModels seeds a fresh policy starts from

    def __post_init__(self) -> None:
        if not self.scorers:
            raise ValueError(f"machine {self.name!r} needs at least one scorer")
        if self.catchup_q < 1:
            raise ValueError(f"machine {self.name!r}: catchup_q must be >= 1, got {self.catchup_q}")

    @property
    def graph_buckets(self) -> dict[str, list[int]]:
        """``CostModels(graph_buckets=...)`` of this machine's graph scorers."""
        return {n: list(s.buckets) for n, s in self.scorers.items() if s.buckets is not None}

    def step_times(
        self, scorer: str, k: np.ndarray, ctx: np.ndarray, is_catchup: bool = False, num_catchup_rows: int = 0
    ) -> StepTimes:
        """Noise-free ms of a decode step: ``k`` ``[B]`` drafts, ``ctx`` ``[B]`` context lengths;
        ``is_catchup``: the draft catches up eagerly, over ``num_catchup_rows`` lagging requests."""
        if scorer not in self.scorers:
            raise ValueError(f"machine {self.name!r} has no scorer {scorer!r}; known: {sorted(self.scorers)}")
        k = np.asarray(k, dtype=np.int64)
        ctx = np.asarray(ctx, dtype=np.float64)
        max_k, num_spec, num_draft = int(k.max(initial=0)), int((k > 0).sum()), int(k.sum())
        propose = 0.0
        if max_k:
            propose = (
                self.draft_bias_ms
                + max_k * (self.draft_forward_ms + self.draft_row_ms * num_spec)
                + self.draft_token_ms * num_draft
                + (self.catchup_ms + self.catchup_row_ms * num_catchup_rows if is_catchup else 0.0)
            )
        tokens = num_draft + len(k)
        return StepTimes(
            propose_ms=propose,
            score_ms=self.scorers[scorer].ms(k, ctx),
            verify_ms=self.verify_bias_ms + self.verify_token_ms * tokens,
            overhead_ms=self.overhead_ms + self.overhead_request_ms * len(k),
        )

    def run_times(self, scorer: str, ctx: np.ndarray, num_steps: int) -> StepTimes:
        """Noise-free ms of a run of ``num_steps`` plain steps (``scheduler.decode_steps``): each
        forward's scoring, one verification read and one host overhead."""
        one = self.step_times(scorer, np.zeros(len(ctx), dtype=np.int64), ctx)
        return StepTimes(0.0, num_steps * one.score_ms, one.verify_ms, one.overhead_ms)


def _h200_llama2_7b() -> Machine:
    return Machine(
        name="h200-llama2-7b",
        scorers={
            "batch_expansion": ScorerCost(
                8.2, row_ms=0.036, row_ctx_ms=0.066, is_expansion=True, buckets=LADDER, eager_ms=15.0
            ),
            "mqa": ScorerCost(24.0, token_ms=0.02, ctx_ms=0.07),
            "mqa_graph": ScorerCost(8.2, token_ms=0.023, ctx_ms=0.07, buckets=LADDER, eager_ms=15.0),
        },  # fmt: skip
        draft_forward_ms=0.9,
        draft_row_ms=0.005,
        draft_token_ms=0.01,
        catchup_ms=2.5,
        verify_bias_ms=0.1,
        verify_token_ms=0.002,
        overhead_ms=0.8,
        overhead_request_ms=0.15,
    )


def _h200_smollm2() -> Machine:
    return Machine(
        name="h200-smollm2-135m",
        scorers={
            "batch_expansion": ScorerCost(
                2.2, row_ms=0.004, row_ctx_ms=0.004, is_expansion=True, buckets=LADDER, eager_ms=8.0
            ),
            "mqa": ScorerCost(9.0, token_ms=0.003, ctx_ms=0.004),
            "mqa_graph": ScorerCost(2.2, token_ms=0.003, ctx_ms=0.004, buckets=LADDER, eager_ms=8.0),
        },  # fmt: skip
        draft_bias_ms=0.03,
        draft_token_ms=0.004,
        verify_bias_ms=0.1,
        verify_token_ms=0.001,
        overhead_ms=0.6,
        overhead_request_ms=0.08,
    )


MACHINES = {"h200-llama2-7b": _h200_llama2_7b, "h200-smollm2-135m": _h200_smollm2}


def get_machine(name: str) -> Machine:
    """A preset machine by name."""
    if name not in MACHINES:
        raise ValueError(f"unknown machine {name!r}; known: {', '.join(MACHINES)}")
    return MACHINES[name]()
