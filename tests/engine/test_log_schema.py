"""Schemas 3 and 4 of the decision log: per-phase host ms of each step, each request's max k and its
prompt's hash, written by the real writer from a real engine's records, and an older (version 2)
file migrated on append."""

from __future__ import annotations

import json

import sqlite_utils

from specsched.daemon.log import LogConfig, LogWriter, open_log
from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.log_schema import SCHEMA_VERSION, prompt_hash
from specsched.engine.request import SamplingParams

V2_SCHEMA = """
CREATE TABLE runs (id INTEGER PRIMARY KEY, started_at REAL, config TEXT, model TEXT,
    device TEXT, version TEXT, schema_version INTEGER, ended_at REAL, num_compiles_after_start INTEGER);
CREATE TABLE requests (run_id INTEGER, request_id TEXT, client TEXT, arrival REAL,
    first_token_time REAL, finish_time REAL, prompt_tokens INTEGER, output_tokens INTEGER,
    finish_reason TEXT, proposed INTEGER, accepted INTEGER);
CREATE TABLE steps (run_id INTEGER, step INTEGER, kind TEXT, start_time REAL,
    batch_size INTEGER, num_tokens INTEGER, scorer TEXT, policy TEXT, proposer TEXT, is_synthetic INTEGER,
    predicted_propose_ms REAL, predicted_score_ms REAL, predicted_verify_ms REAL, predicted_ms REAL,
    propose_ms REAL, score_ms REAL, verify_ms REAL, total_ms REAL, num_emitted INTEGER, plan_info TEXT);
CREATE TABLE step_requests (run_id INTEGER, step INTEGER, request_id TEXT,
    context_len INTEGER, k INTEGER, num_accepted INTEGER, match_bits TEXT, num_emitted INTEGER);
"""


def run_logged_engine(path: str) -> list:
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=256),
        spec=SpecConfig(proposer="ngram", max_k=4, scorers=["batch_expansion", "mqa"]),
        policy={"name": "fixed", "k": 3, "scorer": "mqa"},
    )
    engine = Engine(cfg)
    writer = LogWriter(LogConfig(path=path, flush_interval_s=0.02))
    writer.start_run({}, model="tiny", device="cpu", version="test")
    records = []
    engine.on_step = lambda rec: (records.append(rec), writer.write_step(rec))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]]
    engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    writer.end_run(num_compiles_after_start=0)
    writer.close()
    return records


def test_host_phases_and_max_k_reach_the_file(tmp_path):
    path = str(tmp_path / "log.sqlite")
    records = run_logged_engine(path)
    db = open_log(path)
    steps = {r["step"]: r for r in db.query("select step, kind, host_ms, total_ms from steps")}
    assert len(steps) == len(records)
    for rec in records:
        row = steps[rec.step]
        host = json.loads(row["host_ms"])
        assert set(host) == set(rec.host_ms) and "schedule" in host
        assert abs(sum(host.values()) - sum(rec.host_ms.values())) < 1e-2  # rounded to 0.1 us
        if rec.kind == "decode":
            assert {"view", "decide", "commit", "overlap"} <= set(host)
    rows = list(db.query("select step, request_id, k, max_k from step_requests"))
    assert rows and all(r["max_k"] is not None and 0 <= r["k"] <= r["max_k"] <= 4 for r in rows)
    # the n-gram peek caps max_k: the repeating prompts match, so some request could draft
    assert any(r["max_k"] > 0 for r in rows)
    by_step = {(rec.step, q.request_id): q.max_k for rec in records for q in rec.requests}
    assert all(by_step[(r["step"], r["request_id"])] == r["max_k"] for r in rows)


def test_a_version_2_log_gains_the_new_columns_when_appended_to(tmp_path):
    path = str(tmp_path / "v2.sqlite")
    db = sqlite_utils.Database(path)  # the version 2 schema, as the previous specsched wrote it
    for statement in V2_SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)
    db.execute("INSERT INTO runs (started_at, config, schema_version) VALUES (1.0, '{}', 2)")
    db.execute("INSERT INTO steps (run_id, step, kind, total_ms) VALUES (1, 0, 'decode', 3.0)")
    db.execute("INSERT INTO step_requests (run_id, step, request_id, k) VALUES (1, 0, 'old', 2)")
    db.execute("PRAGMA user_version = 2")
    db.conn.commit()
    db.close()
    run_logged_engine(path)
    db = open_log(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    assert "prompt_hash" in db["requests"].columns_dict
    old = list(db.query("select host_ms from steps where run_id = 1"))
    assert old == [{"host_ms": None}]
    assert list(db.query("select max_k from step_requests where request_id = 'old'")) == [{"max_k": None}]
    assert db.execute("select count(*) from steps where run_id = 2 and host_ms is not null").fetchone()[0] > 0


def test_prompt_hash_names_the_token_ids():
    a = prompt_hash([5, 6, 7])
    assert a == prompt_hash((5, 6, 7)) and len(a) == 16 and int(a, 16) >= 0
    assert len({a, prompt_hash([5, 6, 8]), prompt_hash([5, 6]), prompt_hash([7, 6, 5]), prompt_hash([])}) == 5
    assert prompt_hash([2**40, 1]) != prompt_hash([0, 1])  # every bit of an id counts, not its low byte
