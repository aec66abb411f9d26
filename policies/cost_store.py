"""The cost models in the decision log: one row per model of a run in the ``cost_models`` table
(its features, coefficients, covariance, prior variance, number of updates, forgetting factor; the
run's device and graph buckets on every row), so a restart or an offline replay starts from them.
A graph scorer's per-graph residuals (policies/bucket_bias.py) are one more row, component
``score_bias``: its coefficients hold ``[rows, tokens, steps, mean ms, *mean score features]`` per
graph."""

from __future__ import annotations

import json
from collections.abc import Callable

from specsched.policies.rls import OnlineLinearModel
from specsched.policies.shapes import FEATURES

__all__ = ["COLUMNS", "TABLE", "load_models", "save_models"]

TABLE = "cost_models"
BIAS = "score_bias"  # the component of a scorer's per-graph residuals
COLUMNS = (
    "run_id",
    "component",
    "key",
    "features",
    "coefficients",
    "covariance",
    "prior_var",
    "num_updates",
)


def save_models(
    db,
    run_id: int,
    models: dict[tuple[str, ...], OnlineLinearModel],
    device: str,
    graph_buckets: dict[str, list[int]],
    biases: dict[str, list[list[float]]] | None = None,
) -> None:
    """Write ``models`` (and the scorers' graph residuals ``biases``) to ``db``'s ``cost_models`` table
    under ``run_id`` (replacing it)."""
    buckets = json.dumps(graph_buckets)
    rows = []
    for key, m in sorted(models.items()):
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
                "device": device,
                "graph_buckets": buckets,
            }
        )
    for scorer, entries in sorted((biases or {}).items()):
        rows.append(
            {
                "run_id": int(run_id),
                "component": BIAS,
                "key": scorer,
                "features": json.dumps(
                    ["rows_padded", "tokens_padded", "steps", "mean_ms", *FEATURES["score"]]
                ),
                "coefficients": json.dumps(entries),
                "covariance": "[]",
                "prior_var": "[]",
                "num_updates": len(entries),
                "forgetting": None,
                "device": device,
                "graph_buckets": buckets,
            }
        )
    table = _database(db)[TABLE]
    if table.exists():
        table.delete_where("run_id = ?", [int(run_id)])
    table.insert_all(rows, pk=("run_id", "component", "key"))


def load_models(make: Callable, db, run_id: int | None, graph_buckets: dict[str, list[int]] | None):
    """``make(graph_buckets, device)`` (a :class:`~specsched.policies.cost_model.CostModels`) with
    the models saved for ``run_id`` (None = the latest run saved) loaded into it; graph buckets as
    saved unless given. Raises ValueError naming the database for a missing or malformed table."""
    db = _database(db)
    files = [row[2] for row in db.execute("PRAGMA database_list").fetchall() if row[1] == "main"]
    where = f"in {files[0] if files and files[0] else 'the database'}"
    if TABLE not in db.table_names():
        raise ValueError(f"no {TABLE!r} table {where}: no cost models were saved there")
    missing = [c for c in COLUMNS if c not in db[TABLE].columns_dict]
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
        buckets = graph_buckets if graph_buckets is not None else saved_buckets
        out = make(buckets, first.get("device") or "cpu")
        for row in rows:
            component = row["component"]
            if component == BIAS:
                out.load_bias_state(row["key"], json.loads(row["coefficients"]))
                continue
            if component not in FEATURES:
                raise ValueError(f"unknown component {component!r}")
            if json.loads(row["features"]) != FEATURES[component]:
                raise ValueError(
                    f"{component} saved with features {row['features']}, expected {FEATURES[component]}"
                )
            key = (component, row["key"]) if component in ("score", "propose") else (component,)
            state = {
                "coef": json.loads(row["coefficients"]),
                "cov": json.loads(row["covariance"]),
                "prior_var": json.loads(row["prior_var"]),
                "num_updates": row["num_updates"],
                "forgetting": row.get("forgetting") or out.forgetting,
            }
            out.model(*key).load_state_dict(state)
    except (ValueError, TypeError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed {TABLE!r} row {where} (run_id {run_id}): {e}") from e
    return out


def _database(db):
    import sqlite_utils

    return db if isinstance(db, sqlite_utils.Database) else sqlite_utils.Database(db)
