"""Online cost models: predicted ms of each step component from the step's shape.

One :class:`~specsched.policies.rls.OnlineLinearModel` (recursive least squares with forgetting)
per component: ``("score", scorer)``, ``("propose", proposer)``, ``("verify",)``, ``("overhead",)``,
over the features of :mod:`specsched.policies.shapes`, seeded from per-device priors
(:mod:`specsched.policies.cost_priors`) and saved to (loaded from) the decision log's
``cost_models`` table (:mod:`specsched.policies.cost_store`). What they predict (:class:`StepCost`,
:class:`CostSlopes`) and a record's shape statistics live in :mod:`specsched.policies.step_cost`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from specsched.engine.records import StepRecord
from specsched.policies.bucket_bias import BucketBias, bucket_key
from specsched.policies.cost_priors import FLOOR, PRIORS, seed_coefficients
from specsched.policies.cost_store import load_models, save_models
from specsched.policies.launch_guard import LaunchGuard
from specsched.policies.rls import OnlineLinearModel
from specsched.policies.run_cost import CatchUpCost, RunRatio, run_ms
from specsched.policies.running_error import RunningError
from specsched.policies.shapes import (
    EXPANSION_SCORERS,
    FEATURES,
    ShapeStats,
    StepShape,
    overhead_features,
    propose_features,
    score_features,
    verify_features,
)
from specsched.policies.step_cost import CostSlopes, StepCost, record_stats

__all__ = ["PRIORS", "CostModels", "CostSlopes", "StepCost"]


# A step that took STALL_RATIO times its prediction, from models whose recent prequential error is
# below STALL_FIT, stalled (H100, 2026-12-05: one step of the 7B pair's goodput window took 236 ms
# against 7.5, 233 of it in one host phase; fitted, it made every plan look dearer and goodput ran
# plain steps for the rest of the window): it teaches no model, only the error. Costs that really
# moved that far raise the error over STALL_FIT within a few steps, and the models learn again.
STALL_RATIO = 4.0
STALL_FIT = 0.25


class CostModels:
    """All components' online models; :mod:`specsched.policies.shapes` defines their features."""

    def __init__(
        self,
        graph_buckets: dict[str, list[int]] | None = None,
        device: str = "cpu",
        forgetting: float = 0.99,
        prior_rel_std: float = 10.0,
        expansion_scorers: Sequence[str] = EXPANSION_SCORERS,
        count_between: bool = True,
        bucket_bias: bool = True,
    ) -> None:
        # a step's cost: StepRecord.cost_ms (the caller's time before it included), else total_ms
        self.count_between = count_between
        self.graph_buckets: dict[str, np.ndarray] = {}
        for name, buckets in (graph_buckets or {}).items():
            if not buckets or any(int(b) < 1 for b in buckets):
                raise ValueError(
                    f"graph_buckets[{name!r}] must be a non-empty list of sizes >= 1, got {buckets}"
                )
            self.graph_buckets[name] = np.array(sorted({int(b) for b in buckets}), dtype=np.int64)
        self.forgetting = forgetting
        self.prior_rel_std = prior_rel_std
        self.expansion_scorers = tuple(expansion_scorers)
        self.models: dict[tuple[str, ...], OnlineLinearModel] = {}
        self.num_decodes: dict[str, int] = {}  # plain decode steps (every k = 0) observed per scorer
        self.num_run_steps: dict[str, int] = {}  # plain decode steps observed inside runs, per scorer
        self.errors: dict[str, RunningError] = {}  # scorer -> prequential error of step ms
        # graph scorer -> its score model's residual per graph (policies/bucket_bias.py); off: none
        self.is_bucket_bias = bucket_bias
        self.biases: dict[str, BucketBias] = {}
        # replay only: what a change of the decode batch adds to a step, fitted on a recorded run by
        # policies.replay_costs.refit_costs (policies/replay_churn.py); None: nothing
        self.churn = None
        self.runs: dict[str, RunRatio] = {}  # scorer -> measured / predicted ms of its runs (run_cost.py)
        # proposer -> what its catch-up after plain steps adds to a step's propose ms (run_cost.py)
        self.catchups: dict[str, CatchUpCost] = {}
        self.num_stalls = 0  # steps skipped as stalls (STALL_RATIO)
        self.launch_guard = LaunchGuard()  # steps skipped as disturbed: a slow scoring launch
        self.seed_defaults(device)

    @property
    def num_skipped(self) -> int:
        """Decode steps observed but not learnt: stalls, and slow scoring launches (a loaded host)."""
        return self.num_stalls + self.launch_guard.num_disturbed

    # ---- models and priors ----
    def seed_defaults(self, device: str = "cpu") -> None:
        """Reset every model to the seed coefficients of ``device`` ("cpu" or "cuda")."""
        if device not in PRIORS:
            raise ValueError(f"no cost-model priors for device {device!r}; known: {sorted(PRIORS)}")
        self.device = device
        self.models.clear()
        self.num_decodes.clear()
        self.num_run_steps.clear()
        self.errors.clear()
        self.biases.clear()
        self.runs.clear()
        self.catchups.clear()

    def _prior(self, key: tuple[str, ...]) -> list[float]:
        return seed_coefficients(self.device, key)

    def model(self, *key: str) -> OnlineLinearModel:
        """The model of ``key`` (e.g. ``model("score", "mqa")``), made from the seeds on first use."""
        found = self.models.get(key)
        if found is None:
            if key[0] not in FEATURES or len(key) != (2 if key[0] in ("score", "propose") else 1):
                raise ValueError(
                    f"bad cost-model key {key}; use (score, name), (propose, name), (verify,), (overhead,)"
                )
            coef = self._prior(key)
            scale = np.maximum(np.abs(coef), FLOOR[key[0]]) * self.prior_rel_std
            found = OnlineLinearModel(len(coef), self.forgetting, prior_var=scale**2, coef=coef)
            self.models[key] = found
        return found

    # ---- features ----
    def score_features(self, scorer: str, s: ShapeStats) -> list:
        """The score features of ``scorer`` (see :mod:`specsched.policies.shapes`)."""
        return score_features(s, scorer in self.expansion_scorers, self.graph_buckets.get(scorer))

    def score_bias(self, scorer: str, x: Sequence[float]) -> float:
        """The ms the graph of a step with score features ``x`` adds to ``scorer``'s linear model (0
        for eager steps, graphs not seen yet and scorers without graphs)."""
        found = self.biases.get(scorer)
        return found.value(bucket_key(x), self.model("score", scorer).coef_list) if found else 0.0

    # ---- prediction ----
    def prior_score_ms(self, scorer: str, s: ShapeStats) -> float:
        """Score ms of a shape under ``scorer``'s device seed (its model before any step). The seeds'
        levels are set for one model size and may be far off; their ratio between two scorers at one
        shape is what a model that has not been observed yet can still tell."""
        coef = self._prior(("score", scorer))
        return max(float(np.dot(coef, np.asarray(self.score_features(scorer, s), dtype=np.float64))), 0.0)

    def predict(self, scorer: str, proposer: str, shape: StepShape) -> StepCost:
        """Predicted ms of a step of ``shape`` scored by ``scorer`` with drafts from ``proposer``."""
        return self.predict_stats(scorer, proposer, shape.stats())

    def predict_stats(self, scorer: str, proposer: str, s: ShapeStats) -> StepCost:
        """As :meth:`predict` from aggregates; array fields give array predictions (vectorised search)."""
        if not any(isinstance(v, np.ndarray) for v in vars(s).values()):  # one shape: no numpy call
            # a float; no drafts: no proposer's model (a plain step's price makes none for "none")
            propose = self.model("propose", proposer).predict(propose_features(s)) if s.max_k > 0 else 0.0
            x = self.score_features(scorer, s)
            return StepCost(
                propose_ms=float(propose),
                score_ms=float(self.model("score", scorer).predict(x)) + self.score_bias(scorer, x),
                verify_ms=float(self.model("verify").predict(verify_features(s))),
                overhead_ms=float(self.model("overhead").predict(overhead_features(s))),
            )
        propose = self.model("propose", proposer).predict(propose_features(s))
        propose = np.where(np.asarray(s.max_k) > 0, propose, 0.0)
        x = self.score_features(scorer, s)
        score = self.model("score", scorer).predict(x)
        if self.biases.get(scorer):  # per shape: its graph's residual
            cols = np.broadcast_arrays(*(np.asarray(f, dtype=np.float64) for f in x))
            score = score + np.array(
                [self.score_bias(scorer, f) for f in zip(*(c.ravel() for c in cols))]
            ).reshape(cols[0].shape)
        cost = StepCost(
            propose_ms=propose,
            score_ms=score,
            verify_ms=self.model("verify").predict(verify_features(s)),
            overhead_ms=self.model("overhead").predict(overhead_features(s)),
        )
        if np.ndim(cost.total_ms) == 0:
            cost = StepCost(
                *(float(v) for v in (cost.propose_ms, cost.score_ms, cost.verify_ms, cost.overhead_ms))
            )
        return cost

    def slopes(self, scorer: str, proposer: str) -> CostSlopes:
        """Linearised marginal cost of a draft token under the current coefficients."""
        sc = self.model("score", scorer).coef
        pc = self.model("propose", proposer).coef
        vc = self.model("verify").coef
        rows = sc[1] if scorer in self.expansion_scorers else 0.0
        return CostSlopes(
            token_ms=float(rows + sc[2] + vc[1] + pc[3]),
            context_ms=float(sc[4] / 1e3),
            spec_request_ms=float(pc[2]),
        )

    # ---- learning ----
    def step_ms(self, record: StepRecord) -> float:
        """What a step cost: ``record.cost_ms``, or ``total_ms`` when ``count_between`` is off."""
        return record.cost_ms if self.count_between else record.total_ms

    def observe(self, record: StepRecord) -> bool:
        """Update from a decode step's measured times; returns False for records it skips (prefill,
        empty, a run of plain steps: its own ratio, a stall: :data:`STALL_RATIO`, a slow scoring launch:
        policies/launch_guard.py). Overhead =
        ``total_ms`` minus propose + score + verify (skipped when total is 0), plus
        (``count_between``, the default) the caller's time before the step (``host_ms["between"]``:
        the daemon streaming the last step's outputs), which every step pays too: a policy that
        divides tokens by the step's ms then sees the cost of one more step as it is (H200,
        2026-12-04: 0.14 ms at batch 1, 0.25 at 16, 0.64 at 64, against steps of 1.6-5 ms).

        First the step's ms as predicted before the models learn from it is compared with the
        measured (the prequential error, :meth:`prediction_error`), then each model learns its
        component; the features are computed once for both."""
        reqs = record.requests
        if record.kind != "decode" or not reqs:
            return False
        if record.num_decode_steps != 1:  # a run of plain steps is not one step's cost: its own ratio
            self._observe_run(record)
            return False
        if not record.scorer:
            raise ValueError(f"decode step record {record.step} has no scorer")
        propose_ms, score_ms, verify_ms, total_ms = (
            record.propose_ms, record.score_ms, record.verify_ms, self.step_ms(record),
        )  # fmt: skip
        if not all(math.isfinite(t) and t >= 0 for t in (propose_ms, score_ms, verify_ms, total_ms)):
            times = {n: getattr(record, n) for n in ("propose_ms", "score_ms", "verify_ms", "total_ms")}
            bad = {n: t for n, t in times.items() if not np.isfinite(t) or t < 0}
            raise ValueError(f"step record {record.step} has invalid timings {bad}")
        s = record_stats(record)
        scorer, proposer = record.scorer, record.proposer or "none"
        is_spec = s.max_k > 0
        x_score, x_verify = self.score_features(scorer, s), verify_features(s)
        m_score, m_verify = self.model("score", scorer), self.model("verify")
        m_propose = self.model("propose", proposer) if is_spec else None
        # after plain steps (a run, or one) a draft model's propose caught up over their tokens: a
        # one-off cost of leaving them, not what a speculative step costs (fitted, it made every
        # speculative plan look dearer than the run and kept goodput in runs: the H200's 7B pair at
        # a = 0.3, 2026-12-05, 0.81x fixed k = 3), kept apart as the proposer's catch-up cost
        # (catchup_ms); its score, verify and overhead still teach
        is_caught_up = record.is_after_run and is_spec
        m_overhead = self.model("overhead") if total_ms > 0 else None
        x_propose = propose_features(s) if is_spec else None
        x_overhead = overhead_features(s)

        # prequential: the step's ms as predicted before the models learn from it, against measured
        linear = m_score.predict(x_score)
        predicted = linear + self.score_bias(scorer, x_score) + m_verify.predict(x_verify)
        if m_propose is not None:
            predicted += m_propose.predict(x_propose)
        if m_overhead is not None:
            predicted += m_overhead.predict(x_overhead)
            measured = total_ms
        else:  # no total measured: the three phases
            measured = propose_ms + score_ms + verify_ms
        error = self.errors.get(scorer)
        if error is None:
            error = self.errors[scorer] = RunningError()
        fit = error.value  # before this step: a stall moves the error, and a lasting change ends it
        if not is_caught_up:
            error.update(predicted, measured)
        is_stall = not is_caught_up and fit is not None and fit < STALL_FIT  # a catch-up is no stall
        if is_stall and measured > STALL_RATIO * predicted > 0:
            self.num_stalls += 1  # the host stalled (a collection, the OS): not what the step costs
            return False
        if self.launch_guard.is_disturbed(scorer, s.batch_size, record.host_ms.get("score")):
            return False  # the host was slow to launch the scoring: its score ms carries the delay

        if m_propose is None:
            self.num_decodes[scorer] = self.num_decodes.get(scorer, 0) + 1
        elif not is_caught_up:
            m_propose.update(x_propose, propose_ms)
        else:  # what leaving plain steps cost, over a steady step's propose (weigh_run charges it)
            self.catchups.setdefault(proposer, CatchUpCost()).update(m_propose.predict(x_propose), propose_ms)
        m_score.update(x_score, score_ms)
        if self.is_bucket_bias and scorer in self.graph_buckets:
            self._bias(scorer).update(bucket_key(x_score), x_score, score_ms)
        m_verify.update(x_verify, verify_ms)
        if m_overhead is not None:
            m_overhead.update(x_overhead, max(0.0, total_ms - propose_ms - score_ms - verify_ms))
        return True

    def catchup_ms(self, proposer: str) -> float:
        """What ``proposer``'s catch-up after plain steps adds to a speculative step's propose ms, as
        measured so far (0 before any, and for proposers without a KV cache of their own)."""
        found = self.catchups.get(proposer)
        return found.value if found else 0.0

    def predict_run(self, scorer: str, s: ShapeStats, num_steps: int) -> float:
        """Predicted ms of a run of ``num_steps`` plain steps of shape ``s`` (every k = 0) on
        ``scorer``, corrected by the runs seen (:mod:`specsched.policies.run_cost`)."""
        found = self.runs.get(scorer)
        return run_ms(self, scorer, s, num_steps, found.value if found else 1.0)

    def _observe_run(self, record: StepRecord) -> None:
        """Update the run ratio of ``record.scorer`` from a run's record (its ms against the models'
        prediction before the update)."""
        measured = self.step_ms(record)
        if not record.scorer or not (math.isfinite(measured) and measured > 0):
            return
        predicted = run_ms(self, record.scorer, record_stats(record), record.num_decode_steps)
        self.runs.setdefault(record.scorer, RunRatio()).update(predicted, measured)
        self.num_run_steps[record.scorer] = self.num_run_steps.get(record.scorer, 0) + record.num_decode_steps

    def prediction_error(self, scorer: str, signed: bool = False) -> float | None:
        """Running relative error of ``scorer``'s predicted step ms over its last ~16 steps (each
        predicted before it was learnt from), its size or (``signed``) its mean with sign: the bias;
        None before it has seen a few (:class:`~specsched.policies.running_error.RunningError`)."""
        found = self.errors.get(scorer)
        return None if found is None else (found.bias if signed else found.value)

    def profile(
        self,
        fn: Callable[[StepShape], StepRecord | Iterable[StepRecord]],
        grid: Iterable[StepShape],
        repeats: int = 1,
    ) -> int:
        """Start-up profile: ``fn(shape)`` runs (or times) a step of each grid shape and returns its
        record(s); each is observed. Returns the number of records used."""
        num = 0
        for _ in range(repeats):
            for shape in grid:
                out = fn(shape)
                for record in [out] if isinstance(out, StepRecord) else out:
                    num += self.observe(record)
        return num

    @staticmethod
    def shape_grid(
        batch_sizes: Iterable[int], ks: Iterable[int], context_lens: Iterable[int]
    ) -> list[StepShape]:
        """Uniform shapes (every request the same k and context) over the product of the three."""
        return [StepShape([k] * b, [c] * b) for b in batch_sizes for k in ks for c in context_lens]

    # ---- persistence ----
    def save(self, db, run_id: int) -> None:
        """Write every model to ``db``'s ``cost_models`` table under ``run_id`` (replacing it)."""
        self.model("verify"), self.model("overhead")  # so a fresh set still records device and buckets
        buckets = {n: b.tolist() for n, b in self.graph_buckets.items()}
        biases = {n: b.state() for n, b in self.biases.items() if b}
        save_models(db, run_id, self.models, self.device, buckets, biases)

    def load_bias_state(self, scorer: str, entries: list[list[float]]) -> None:
        """``scorer``'s per-graph residuals as :meth:`BucketBias.state` gave them (a saved run's)."""
        self._bias(scorer).load_state(entries)

    def _bias(self, scorer: str) -> BucketBias:
        """``scorer``'s per-graph residuals, made empty on first use."""
        found = self.biases.get(scorer)
        if found is None:
            found = self.biases[scorer] = BucketBias()
        return found

    @classmethod
    def load(
        cls, db, run_id: int | None = None, graph_buckets: dict[str, list[int]] | None = None
    ) -> CostModels:
        """Models saved for ``run_id`` (None = the latest run saved); graph buckets as saved unless given."""
        return load_models(lambda buckets, device: cls(buckets, device=device), db, run_id, graph_buckets)
