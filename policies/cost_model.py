"""Online cost models: predicted ms of each step component from the step's shape.

One :class:`~specsched.policies.rls.OnlineLinearModel` (recursive least squares with forgetting)
per component: ``("score", scorer)``, ``("propose", proposer)``, ``("verify",)``, ``("overhead",)``,
over the features of :mod:`specsched.policies.shapes`, seeded from per-device priors and saved to
(loaded from) the decision log's ``cost_models`` table.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from specsched.engine.records import StepRecord
from specsched.policies.rls import OnlineLinearModel
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

__all__ = ["CostModels", "CostSlopes", "StepCost"]

_FLOOR = {  # smallest prior std scale per feature (ms per unit) so unseeded features still learn
    "score": [1.0, 0.01, 0.01, 0.01, 0.01, 1.0],
    "propose": [0.1, 0.1, 0.01, 0.01],
    "verify": [0.1, 0.001],
    "overhead": [0.1, 0.01],
}
# Seed coefficients ("*" = any other name). cpu: the tiny / 135M models in float32 on a few cores;
# cuda: llama2-7b on an H200, least squares over the 2026-12-02 scorer table of docs/benchmarks.md
# (graph scorers 8.2 ms + 0.036 ms per batch-expansion row + 0.066 ms per row per 1k context, or +
# 0.023 ms per MQA token + 0.07 ms per 1k context; eager MQA ~24 ms), the llama-68m draft at ~0.9 ms
# per forward with its host work (the bench's synthetic proposer runs it too), host overhead 0.8 ms
# + 0.15 ms per request (its non-speculative end-to-end rows).
PRIORS: dict[str, dict] = {
    "cpu": {
        "score": {
            "batch_expansion": [2.0, 0.05, 0.2, 0.01, 0.02, 0.0],
            "mqa": [2.0, 0.05, 0.2, 0.01, 0.01, 0.0],
            "*": [2.0, 0.05, 0.2, 0.01, 0.02, 0.0],
        },
        "propose": {
            "draft": [0.2, 0.6, 0.05, 0.0],
            "ngram": [0.05, 0.0, 0.0, 0.002],
            "*": [0.05, 0.0, 0.0, 0.01],
        },
        "verify": [0.05, 0.005],
        "overhead": [0.3, 0.02],
    },
    "cuda": {
        "score": {
            "batch_expansion": [8.2, 0.036, 0.0, 0.0, 0.066, 15.0],
            "mqa": [24.0, 0.0, 0.02, 0.07, 0.0, 0.0],
            "mqa_graph": [8.2, 0.0, 0.023, 0.07, 0.0, 15.0],
            "*": [15.0, 0.0, 0.02, 0.1, 0.05, 0.0],
        },
        "propose": {
            "draft": [0.3, 0.9, 0.005, 0.01],
            "synthetic": [0.3, 0.9, 0.005, 0.01],
            "ngram": [0.05, 0.0, 0.0, 0.001],
            "*": [0.05, 0.0, 0.0, 0.001],
        },
        "verify": [0.1, 0.002],
        "overhead": [0.8, 0.15],
    },
}
TABLE = "cost_models"
_COLUMNS = (
    "run_id",
    "component",
    "key",
    "features",
    "coefficients",
    "covariance",
    "prior_var",
    "num_updates",
)


@dataclass
class StepCost:
    """Predicted ms per component (floats, or arrays when predicted for many shapes at once)."""

    propose_ms: float
    score_ms: float
    verify_ms: float
    overhead_ms: float

    @property
    def total_ms(self) -> float:
        return self.propose_ms + self.score_ms + self.verify_ms + self.overhead_ms

    def as_dict(self) -> dict[str, float]:
        return {
            name: float(getattr(self, name))
            for name in ("propose_ms", "score_ms", "verify_ms", "overhead_ms")
        }


@dataclass
class CostSlopes:
    """Marginal ms of one more draft token, linearised (bucket padding ignored), for a search."""

    token_ms: float  # per draft token
    context_ms: float  # per draft token, per context token of its request
    spec_request_ms: float  # per drafting request, per unit of the batch's max k


class CostModels:
    """All components' online models; :mod:`specsched.policies.shapes` defines their features."""

    def __init__(
        self,
        graph_buckets: dict[str, list[int]] | None = None,
        device: str = "cpu",
        forgetting: float = 0.99,
        prior_rel_std: float = 10.0,
        expansion_scorers: Sequence[str] = EXPANSION_SCORERS,
    ) -> None:
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
        self.errors: dict[str, RunningError] = {}  # scorer -> prequential error of step ms
        self.seed_defaults(device)

    # ---- models and priors ----
    def seed_defaults(self, device: str = "cpu") -> None:
        """Reset every model to the seed coefficients of ``device`` ("cpu" or "cuda")."""
        if device not in PRIORS:
            raise ValueError(f"no cost-model priors for device {device!r}; known: {sorted(PRIORS)}")
        self.device = device
        self.models.clear()
        self.num_decodes.clear()
        self.errors.clear()

    def _prior(self, key: tuple[str, ...]) -> list[float]:
        table = PRIORS[self.device][key[0]]
        if not isinstance(table, dict):
            return list(table)
        if key[0] == "score":
            return list(table.get(key[1], table["*"]))
        # a mixed batch's proposer label joins its proposers with "+": their costs add up
        parts = [table.get(name, table["*"]) for name in key[1].split("+") if name != "none"]
        return [sum(c) for c in zip(*parts, strict=True)] if parts else [0.0] * len(FEATURES["propose"])

    def model(self, *key: str) -> OnlineLinearModel:
        """The model of ``key`` (e.g. ``model("score", "mqa")``), made from the seeds on first use."""
        found = self.models.get(key)
        if found is None:
            if key[0] not in FEATURES or len(key) != (2 if key[0] in ("score", "propose") else 1):
                raise ValueError(
                    f"bad cost-model key {key}; use (score, name), (propose, name), (verify,), (overhead,)"
                )
            coef = self._prior(key)
            scale = np.maximum(np.abs(coef), _FLOOR[key[0]]) * self.prior_rel_std
            found = OnlineLinearModel(len(coef), self.forgetting, prior_var=scale**2, coef=coef)
            self.models[key] = found
        return found

    # ---- features ----
    def score_features(self, scorer: str, s: ShapeStats) -> list:
        """The score features of ``scorer`` (see :mod:`specsched.policies.shapes`)."""
        return score_features(s, scorer in self.expansion_scorers, self.graph_buckets.get(scorer))

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
        propose = self.model("propose", proposer).predict(propose_features(s))
        propose = np.where(np.asarray(s.max_k) > 0, propose, 0.0)
        cost = StepCost(
            propose_ms=propose,
            score_ms=self.model("score", scorer).predict(self.score_features(scorer, s)),
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
    def observe(self, record: StepRecord) -> bool:
        """Update from a decode step's measured times; returns False for records it skips (prefill,
        empty). Overhead = ``total_ms`` minus propose + score + verify (skipped when total is 0)."""
        if record.kind != "decode" or not record.requests:
            return False
        if not record.scorer:
            raise ValueError(f"decode step record {record.step} has no scorer")
        times = {n: getattr(record, n) for n in ("propose_ms", "score_ms", "verify_ms", "total_ms")}
        bad = {n: t for n, t in times.items() if not np.isfinite(t) or t < 0}
        if bad:
            raise ValueError(f"step record {record.step} has invalid timings {bad}")
        shape = StepShape([r.k for r in record.requests], [r.context_len + 1 for r in record.requests])
        s = shape.stats()
        self._track_error(record, s)
        if s.max_k > 0:
            self.model("propose", record.proposer or "none").update(propose_features(s), record.propose_ms)
        else:
            self.num_decodes[record.scorer] = self.num_decodes.get(record.scorer, 0) + 1
        self.model("score", record.scorer).update(self.score_features(record.scorer, s), record.score_ms)
        self.model("verify").update(verify_features(s), record.verify_ms)
        if record.total_ms > 0:
            overhead = max(0.0, record.total_ms - record.propose_ms - record.score_ms - record.verify_ms)
            self.model("overhead").update(overhead_features(s), overhead)
        return True

    def _track_error(self, record: StepRecord, s: ShapeStats) -> None:
        """Prequential: the step's ms as predicted before the models learn from it, against measured."""
        predicted = self.model("score", record.scorer).predict(self.score_features(record.scorer, s))
        predicted += self.model("verify").predict(verify_features(s))
        if s.max_k > 0:
            predicted += self.model("propose", record.proposer or "none").predict(propose_features(s))
        measured = record.total_ms
        if measured > 0:
            predicted += self.model("overhead").predict(overhead_features(s))
        else:  # no total measured: the three phases
            measured = record.propose_ms + record.score_ms + record.verify_ms
        self.errors.setdefault(record.scorer, RunningError()).update(predicted, measured)

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
        buckets = json.dumps({n: b.tolist() for n, b in self.graph_buckets.items()})
        rows = []
        for key, m in sorted(self.models.items()):
            state = m.state_dict()
            rows.append(
                {
                    "run_id": int(run_id),
                    "component": key[0],
                    "key": key[1] if len(key) > 1 else "",
                    "features": json.dumps(FEATURES[key[0]]),
                    "coefficients": json.dumps(state["coef"]),
                    "covariance": json.dumps(state["cov"]),
                    "prior_var": json.dumps(state["prior_var"]),
                    "num_updates": state["num_updates"],
                    "forgetting": state["forgetting"],
                    "device": self.device,
                    "graph_buckets": buckets,
                }
            )
        table = _database(db)[TABLE]
        if table.exists():
            table.delete_where("run_id = ?", [int(run_id)])
        table.insert_all(rows, pk=("run_id", "component", "key"))

    @classmethod
    def load(
        cls, db, run_id: int | None = None, graph_buckets: dict[str, list[int]] | None = None
    ) -> CostModels:
        """Models saved for ``run_id`` (None = the latest run saved); graph buckets as saved unless given."""
        db = _database(db)
        files = [row[2] for row in db.execute("PRAGMA database_list").fetchall() if row[1] == "main"]
        where = f"in {files[0] if files and files[0] else 'the database'}"
        if TABLE not in db.table_names():
            raise ValueError(f"no {TABLE!r} table {where}: no cost models were saved there")
        missing = [c for c in _COLUMNS if c not in db[TABLE].columns_dict]
        if missing:
            raise ValueError(f"malformed {TABLE!r} table {where}: missing columns {missing}")
        if run_id is None:
            run_id = next(iter(db.query(f"select max(run_id) as r from {TABLE}")))["r"]
        rows = list(db[TABLE].rows_where("run_id = ?", [run_id]))
        if not rows:
            raise ValueError(f"no cost models saved for run_id {run_id} {where}")
        try:
            first = rows[0]
            saved_buckets = json.loads(first.get("graph_buckets") or "{}")
            out = cls(
                graph_buckets if graph_buckets is not None else saved_buckets,
                device=first.get("device") or "cpu",
            )
            for row in rows:
                component = row["component"]
                if component not in FEATURES:
                    raise ValueError(f"unknown component {component!r}")
                if json.loads(row["features"]) != FEATURES[component]:
                    raise ValueError(
                        f"{component} saved with features {row['features']}, expected {FEATURES[component]}"
                    )
                key = (component, row["key"]) if component in ("score", "propose") else (component,)
                m = out.model(*key)
                state = {
                    "coef": json.loads(row["coefficients"]),
                    "cov": json.loads(row["covariance"]),
                    "prior_var": json.loads(row["prior_var"]),
                    "num_updates": row["num_updates"],
                    "forgetting": row.get("forgetting") or out.forgetting,
                }
                m.load_state_dict(state)
        except (ValueError, TypeError, KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed {TABLE!r} row {where} (run_id {run_id}): {e}") from e
        return out


def _database(db):
    import sqlite_utils

    return db if isinstance(db, sqlite_utils.Database) else sqlite_utils.Database(db)
