"""bench/cost_replay.py: a real decision log replayed through fresh cost models with the guards on and
off. The log: batch-1 MQA-graph steps at 4 and 9 tokens, all 1.05 ms, then a busy-host stretch (the
scoring launch at 1.2-1.7 ms against 0.24, the score 2.2-2.9 ms) on the 9-token graph, then the 4-token
graph alone: as goodput met it in the H100 serve log of 2026-12-06 14:12."""

from __future__ import annotations

import pytest

from specsched.bench.cost_replay import main, replay_costs
from specsched.daemon.log import LogWriter
from specsched.daemon.log_config import LogConfig
from specsched.engine.records import StepRecord, StepRequestRecord
from specsched.policies.cost_model import CostModels


def step(i: int, k: int, score: float, launch: float) -> StepRecord:
    return StepRecord(
        i, "decode", float(i), 1, k + 1, scorer="mqa_graph", proposer="ngram",
        requests=[StepRequestRecord("r0", 299, k, 1, "1" + "0" * (k - 1), 2, 8)],
        propose_ms=0.04, score_ms=score, verify_ms=0.02, total_ms=score + 0.3,
        host_ms={"score": launch, "between": 0.05},
    )  # fmt: skip


@pytest.fixture(scope="module")
def log(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cost-replay") / "goodput.sqlite"
    w = LogWriter(LogConfig(path=str(path)))
    w.start_run({"policy": {"name": "goodput"}}, model="tiny", device="cuda", version="test")
    steps = [step(i, 8 if i % 2 else 3, 1.05 + 0.005 * (i % 3), 0.24) for i in range(600)]
    steps += [step(600 + i, 8, 2.2 + 0.07 * i, 1.2 + 0.05 * i) for i in range(10)]
    steps += [step(610 + i, 3, 1.05, 0.24) for i in range(500)]
    for rec in steps:
        w.write_step(rec)
    w.save_costs(CostModels({"mqa_graph": [1, 2, 4, 8, 9, 16]}, device="cuda"))
    assert w.flush()
    w.close()
    return str(path)


def test_the_guards_keep_a_busy_stretch_out_of_the_graphs_price(log, capsys):
    before = replay_costs(log, winsorized=False, guard=False, every=50)
    both = replay_costs(log, every=50)
    assert before["num_steps"] == both["num_steps"] == 1110
    assert before["num_disturbed"] == 0 and both["num_disturbed"] == 10
    assert before["gap_ms"] > 0.1 and abs(both["gap_ms"]) < 0.02, (before["gap_ms"], both["gap_ms"])
    assert set(both["errors"]) == {("mqa_graph", "1")}
    assert main([log, "--variants", "before", "both"]) == 0
    out = capsys.readouterr().out
    assert "| before |" in out and "| both |" in out and "10 / 1110" in out
