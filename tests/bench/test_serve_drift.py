"""bench/serve_drift.py: the host's speed loop by loop, from real decision logs."""

from __future__ import annotations

import pytest

from specsched.bench.serve_drift import (
    PHASES,
    config_of,
    drift_table,
    log_loops,
    main,
    round_host_ms,
    rounds_table,
    threads_table,
    with_indices,
)
from specsched.daemon.log import LogWriter
from specsched.daemon.log_config import LogConfig
from specsched.engine.records import StepRecord


def write_log(path, loops: list[tuple[float, int, int, float]]) -> str:
    """A log of loops (start s, batch size, steps, host scale): each loop's decode steps 1 ms apart,
    every phase's host ms = its base below x the loop's scale; one step at half the batch size."""
    base = {"between": 0.04, "schedule": 0.005, "score": 0.3, "commit": 0.03, "first_event": 0.025,
            "events": 0.05, "view": 0.07}  # fmt: skip
    log = LogWriter(LogConfig(path=str(path)))
    log.start_run({"config": "test"}, model="tiny", device="cpu", version="test")
    num = 0
    for start, batch, steps, scale in loops:
        for j in range(steps):
            num += 1
            b = batch if j != 3 else max(batch // 2, 1)  # clients between requests: not a steady step
            t = start + j * 1e-3
            rec = StepRecord(num, "decode", t, b, 4 * b, "mqa_graph", score_ms=1.0, total_ms=1.5)
            rec.host_ms = {p: v * scale for p, v in base.items()}
            log.write_step(rec)
    assert log.flush()
    log.close()
    return str(path)


def test_loops_are_cut_at_gaps_and_indexed_against_their_configs_other_loops(tmp_path):
    a_loops = [(100.0, 4, 30, 1.0), (110.0, 4, 30, 1.4), (120.0, 16, 20, 1.0)]
    a = write_log(tmp_path / "goodput.sqlite", a_loops)
    b = write_log(tmp_path / "goodput_replica_2.sqlite", [(105.0, 4, 30, 1.0), (130.0, 16, 20, 1.0)])
    c = write_log(tmp_path / "k8.sqlite", [(101.0, 4, 30, 1.0), (111.0, 4, 30, 1.2), (2.0, 4, 3, 9.0)])
    loops = with_indices([lp for p in (a, b, c) for lp in log_loops(p)])
    assert [lp.start for lp in loops] == sorted(lp.start for lp in loops)  # time order, across logs
    got = {(lp.daemon, round(lp.start)): lp for lp in loops}
    assert (("k8", 2) not in got) and len(loops) == 7  # a loop of 3 steps is left out
    slow = got[("goodput", 110)]
    assert slow.n == 4 and slow.num_steps == 29  # the batch-2 step is not a steady one
    assert slow.phase_ms["score"] == pytest.approx(0.42)
    # goodput at N = 4: three loops (replica 2's pooled) at scales 1.0, 1.4, 1.0: median 1.0
    assert slow.index == pytest.approx(1.4) and got[("goodput_replica_2", 105)].index == pytest.approx(1.0)
    assert got[("k8", 111)].index == pytest.approx(1.2 / 1.1)  # two loops: their mean is the reference
    assert got[("goodput", 120)].index == pytest.approx(1.0)  # another N: its own reference
    text = drift_table(loops)
    row = next(line for line in text.splitlines() if line.startswith("| 10.0 | goodput | 4 |"))
    assert "| 1.40 |" in row and "0.420" in row
    assert "N = 4: host index 0.91-1.40, 1 of 5 loops ≥ 1.15" in text
    assert drift_table([]) == ""
    # each round's loop of goodput at N = 4 in time order (both replicas): between + first_event +
    # score + commit = 0.395 ms at scale 1
    assert round_host_ms(loops, "goodput", 4, 3) == pytest.approx([0.395, 0.395, 0.395 * 1.4])
    assert round_host_ms(loops, "goodput", 4, 2) == pytest.approx([0.395, 0.395 * 1.4])  # the last two
    assert round_host_ms(loops, "goodput", 4, 4) is None and round_host_ms(loops, "k8", 64, 1) is None
    assert config_of("ngram_goodput_replica_2") == "ngram_goodput" and config_of("k8") == "k8"
    assert set(PHASES) <= {"between", "schedule", "score", "commit", "first_event", "events"}


def test_the_cli_prints_the_table_and_refuses_logs_without_steps(tmp_path, capsys):
    log = write_log(tmp_path / "x.sqlite", [(1.0, 4, 10, 1.0), (5.0, 4, 10, 1.3)])
    out = tmp_path / "drift.md"
    main([log, "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| 4.0 | x | 4 | 9 |" in printed and out.read_text() == printed
    with pytest.raises(SystemExit, match="no decode steps"):
        main([str(tmp_path / "missing.sqlite")])


def test_the_rounds_table_sets_each_loops_tok_s_host_ms_switches_and_load_side_by_side():
    rows = [
        {"config": "k8", "concurrency": 4, "pass": p, "round_tok_s": [4526.0, 4042.5],
         "round_host_ms": [0.368, 0.5], "round_switches": [3, 41], "round_load_share": [0.31, 0.574]}
        for p in (1, 2)
    ] + [
        {"config": "goodput", "concurrency": 1, "pass": 1, "round_tok_s": [1070.0], "round_host_ms": None,
         "round_switches": None},
        {"config": "base", "concurrency": 4, "pass": 1, "round_tok_s": None},
    ]  # fmt: skip
    lines = [ln for ln in rounds_table(rows).splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    # one line per (config, N) whatever its passes, by N; a row without the logs' numbers shows dashes
    assert lines == ["| goodput | 1 | 1070 / – / – / – |",
                     "| k8 | 4 | 4526 / 0.368 / 3 / 0.31; 4042 / 0.500 / 41 / 0.57 |"]  # fmt: skip
    assert "Load-bound" not in rounds_table(rows)
    assert rounds_table([{"config": "x", "concurrency": 1, "round_tok_s": None}]) == ""
    busy = [{"config": "k8", "concurrency": 64, "round_tok_s": [9e3, 8e3], "round_load_share": [0.5, 0.93]}]
    want = ("Load-bound loops (a load process at ≥ 0.8 of a core: its clients may have set the pace, not the "
            "daemon): k8 at N = 64, round 2.")  # fmt: skip
    assert rounds_table(busy).endswith(want)


def test_the_threads_table_sums_the_python_threads_of_each_loop():
    rows = [
        {"config": "goodput", "concurrency": 64, "pass": p, "round_threads": [
            {"engine": 0.61, "io": 0.22, "log": 0.09, "process": 1.4, "engine_runqueue": 0.01},
            {"engine": 0.5, "process": 1.0},
        ]} for p in (1, 2)
    ] + [{"config": "k8", "concurrency": 64, "round_threads": [None, None]}]  # fmt: skip
    lines = [ln for ln in threads_table(rows).splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    # one line per (config, N); a counter the daemon did not report shows a dash; no numbers, no line
    want = "| goodput | 64 | 0.61 / 0.22 / 0.09 / 0.92 / 1.40 / 0.01; 0.50 / – / – / 0.50 / 1.00 / – |"
    assert lines == [want]
    assert threads_table([{"config": "x", "concurrency": 1}]) == ""
