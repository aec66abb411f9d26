"""bench/serve_shapes.py: the same step shape's time in each daemon, from real decision logs."""

from __future__ import annotations

from specsched.bench.serve_shapes import shape_rows, shape_table
from specsched.daemon.log import LogWriter
from specsched.daemon.log_config import LogConfig
from specsched.engine.records import StepRecord


def write_log(path, steps: list[tuple[int, str, int, float, float]]) -> str:
    """A log of decode steps (batch size, scorer, tokens, score ms, step ms), and a prefill."""
    log = LogWriter(LogConfig(path=str(path)))
    log.start_run({"config": "test"}, model="tiny", device="cpu", version="test")
    log.write_step(StepRecord(0, "prefill", 0.0, 1, 30, score_ms=3.0, total_ms=3.5))
    for i, (batch, scorer, tokens, score, total) in enumerate(steps, 1):
        log.write_step(
            StepRecord(i, "decode", float(i), batch, tokens, scorer, score_ms=score, total_ms=total)
        )
    assert log.flush()
    log.close()
    return str(path)


def test_the_table_compares_configs_at_the_shapes_they_share(tmp_path):
    fast_steps = [(4, "mqa_graph", 20, 1.10, 1.40)] * 25 + [(4, "mqa_graph", 36, 1.15, 1.45)] * 30
    fast = write_log(tmp_path / "fast.sqlite", fast_steps + [(1, "mqa_graph", 9, 1.0, 1.2)] * 25)
    slow_steps = [(4, "mqa_graph", 20, 1.14, 1.50)] * 21 + [(4, "mqa_graph", 20, 1.16, 1.52)] * 2
    slow = write_log(tmp_path / "slow.sqlite", slow_steps + [(4, "batch_expansion", 20, 1.2, 1.5)] * 40)
    rows = shape_rows(fast, "k=8", [1, 4]) + shape_rows(slow, "goodput", [1, 4])
    got = {(r["config"], r["concurrency"], r["scorer"], r["num_tokens"]): r for r in rows}
    assert got[("goodput", 4, "mqa_graph", 20)]["num_steps"] == 23
    assert got[("goodput", 4, "mqa_graph", 20)]["score_ms"] == 1.14  # the median, prefill left out
    assert ("k=8", 1, "mqa_graph", 9) in got and not any(k[2] is None for k in got)
    text = shape_table(rows)
    lines = [line for line in text.splitlines() if line.startswith("| 4 |")]
    # only mqa_graph at 20 tokens has >= 20 steps in both: the one row at N = 4; N = 1 has one config
    assert lines == ["| 4 | mqa_graph | 20 | 1.100 / 1.400 (25) | 1.140 / 1.500 (23) |"], text
    assert "| 1 |" not in text
    assert shape_table(shape_rows(fast, "k=8", [4])) == ""  # one config: nothing to compare
    assert shape_rows(tmp_path / "missing.sqlite", "x", [4]) == []
