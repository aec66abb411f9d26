"""bench/plan_gap.py on logs written by the real LogWriter: tokens per step, step ms and their gap
against the reference, drafts against their caps, slow decides and exploration."""

from __future__ import annotations

import pytest

from specsched.bench.plan_gap import compare, main, read_log
from specsched.daemon.log import LogConfig, LogWriter
from specsched.engine.records import StepRecord, StepRequestRecord


def write(path, steps: list[tuple[float, dict, dict, list[tuple[int, int, int]]]], scorer="mqa_graph") -> str:
    """Decode steps (total_ms, host_ms, plan_info, [(k, accepted, max_k) per request]); each request
    emits its accepted drafts + 1."""
    with LogWriter(LogConfig(path=str(path), flush_interval_s=0.05)) as log:
        log.start_run({"policy": {"name": "x"}}, model="hand", device="cpu", version="test")
        for i, (ms, host, info, reqs) in enumerate(steps):
            recs = [
                StepRequestRecord(f"r{j}", 10, k, a, "1" * a, a + 1, cap)
                for j, (k, a, cap) in enumerate(reqs)
            ]
            emitted = sum(a + 1 for _, a, _ in reqs)
            num_tokens = len(reqs) + sum(k for k, _, _ in reqs)
            rec = StepRecord(i, "decode", 1.0, len(reqs), num_tokens, scorer, "x", "ngram", score_ms=1.0,
                             total_ms=ms, num_emitted=emitted, plan_info=info, host_ms=host,
                             requests=recs)  # fmt: skip
            log.write_step(rec)
    return str(path)


def cells(text: str, name: str, batch: int) -> dict[str, str]:
    lines = text.splitlines()
    names = [c.strip() for c in lines[0].strip("|").split("|")]
    row = next(line for line in lines if line.startswith(f"| {name} | {batch} |"))
    return dict(zip(names, (c.strip() for c in row.strip("|").split("|"))))


def test_the_gap_splits_into_tokens_per_step_and_step_ms(tmp_path):
    # reference: 2 requests drafting their whole cap of 4, 3 accepted each: 8 tokens in 2.0 ms
    ref = write(tmp_path / "k8.sqlite", [(2.0, {"between": 0.0}, {}, [(4, 3, 4), (4, 3, 4)])] * 4)
    # other: one request below its cap (6 tokens a step), 2.5 ms steps with between, a slow decide, a probe
    steps = [(2.0, {"between": 0.5, "decide": 0.01}, {}, [(2, 2, 4), (4, 2, 4)])] * 3
    steps.append((2.0, {"between": 0.5, "decide": 0.9}, {"is_probe": True}, [(2, 2, 4), (4, 2, 4)]))
    cur = write(tmp_path / "goodput.sqlite", steps)
    by = read_log(cur, [2])[2]
    assert by.num_steps == 4 and by.tokens_per_step == 6.0 and by.mean_ms == 2.5
    assert (by.num_drafts, by.num_cap, by.num_below_cap, by.num_accepted) == (24, 32, 4, 16)
    assert by.slow_decide_ms == [2.5] and by.num_explore == 1

    text = compare([ref, cur], [2])
    row = cells(text, "goodput", 2)
    assert row["tok/step vs ref"] == "-25.0 %"  # 6 vs 8
    assert row["step ms vs ref"] == "+25.0 %"  # 2.5 vs 2.0
    assert row["tok/ms vs ref"] == "-40.0 %"  # 2.4 vs 4.0 = 0.75 / 1.25
    assert row["k / cap"] == "0.75" and row["below cap"] == "50%" and row["accept."] == "0.67"
    assert row["slow decides (step ms)"] == "25% (2.500)" and row["explore"] == "25%"
    assert cells(text, "k8", 2)["tok/ms vs ref"] == "+0.0 %"


def test_other_batch_sizes_and_missing_ones(tmp_path, capsys):
    ref = write(tmp_path / "a.sqlite", [(1.0, {}, {}, [(1, 1, 2)])] * 2 + [(3.0, {}, {}, [(1, 0, 1)] * 3)])
    text = compare([ref], [1, 3, 5])
    assert cells(text, "a", 1)["steps"] == "2" and cells(text, "a", 3)["tok/step"] == "3.00"
    assert cells(text, "a", 5)["steps"] == "0"
    assert main([ref, "--batch", "1", "--out", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text() == capsys.readouterr().out


def test_a_missing_log_names_itself(tmp_path):
    with pytest.raises(Exception, match="no such log file"):
        read_log(str(tmp_path / "none.sqlite"), [1])


def test_one_run_of_a_file_with_many(tmp_path):
    """``PATH:RUN_ID`` picks a run (a regret cell's log holds one per window); an unknown one is named."""
    path = write(tmp_path / "cell.sqlite", [(1.0, {}, {}, [(2, 2, 2)])] * 3)  # run 1: 3 tokens a step
    write(tmp_path / "cell.sqlite", [(1.0, {}, {}, [(2, 0, 2)])] * 2)  # run 2 of the same file: 1
    assert read_log(path, [1])[1].tokens_per_step == 1.0  # the last run by default
    assert read_log(path, [1], run_id=1)[1].tokens_per_step == 3.0
    text = compare([f"{path}:2", f"{path}:1"], [1])
    assert cells(text, "cell:1", 1)["tok/step vs ref"] == "+200.0 %"
    with pytest.raises(ValueError, match="no run 7"):
        read_log(path, [1], run_id=7)
