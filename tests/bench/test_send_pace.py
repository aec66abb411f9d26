"""bench/send_pace.py end to end on a few steps: a real ZeroMQ client process gets the replies, and the
table has a row per pacing mode."""

from __future__ import annotations

from specsched.bench.send_pace import MODES, main


def test_send_pace_bench_runs_every_mode(capsys):
    main(["--batch", "2", "--steps", "40", "--rounds", "1", "--wait-us", "100"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| daemon")]
    assert [r.split("|")[1].strip() for r in rows] == list(MODES)
    assert all(float(r.split("|")[2]) > 0 for r in rows)  # host ms per step
