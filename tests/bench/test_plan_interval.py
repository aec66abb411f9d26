"""bench/plan_interval.py: the decide budget's interval on a recorded run, under each measure."""

from __future__ import annotations

import pytest

from specsched.bench.plan_interval import interval_rows, interval_table, main
from tests.bench.test_serve_plans import AHEAD, CARRIED, DECIDING, write_log


def test_counting_the_spill_stretches_the_interval(tmp_path, capsys):
    # per cycle of 5 steps at batch 4: three carried, one whose scoring held a 0.6 ms decide, the one
    # after it (its spill 0.18 ms over the carried steps'); steps of 1.4-1.5 ms, a 2 % budget (~0.03 ms)
    ahead = ({**AHEAD[0], "decide_ms": 0.6}, AHEAD[1])
    cycle = [(4, *CARRIED, 1.40)] * 3 + [(4, *DECIDING, 1.49), (4, *ahead, 1.53)]
    log = write_log(tmp_path / "goodput.sqlite", cycle * 20)
    rows = {r["measure"]: r for r in interval_rows(log, [4], budget=0.02, max_age=16)}
    # the deciding step alone: its 0.99 ms after the launch against 0.90 carried
    assert rows["step"]["exposed_ms"] == pytest.approx(0.09, abs=0.01)
    # with the next step's 0.46 ms of spill phases against 0.28
    assert rows["exposed"]["exposed_ms"] == pytest.approx(0.27, abs=0.02)
    assert rows["step"]["interval"] <= 4 and rows["exposed"]["interval"] >= 8
    assert "| 4 | exposed | 96 | 0.271 | 12.0 |" in interval_table(list(rows.values()))  # from the 5th step
    main([log, "--concurrency", "4"])
    assert "decide_cost" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no decode steps"):
        main([log, "--concurrency", "16"])
