from __future__ import annotations

from specsched.bench import log_pace


def test_log_pace_runs_every_mode_and_reports_each(capsys):
    log_pace.main(["--batch", "4", "--steps", "40", "--rounds", "1", "--wait-us", "100"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| log.pace")]
    assert [r.split("|")[1].strip() for r in rows] == ["none", "record", "step"]
    assert rows[0].split("|")[-2].strip() == "+0.000"  # the no-log row is the baseline


def test_run_writes_every_step_to_the_real_log(tmp_path, monkeypatch):
    import sqlite3

    monkeypatch.setattr(log_pace.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    times = log_pace.run("step", batch=3, steps=20, wait_us=50, finish_every=5)
    assert len(times) == 18 and all(t > 0 for t in times)
    db = sqlite3.connect(tmp_path / "log.sqlite")
    assert db.execute("select count(*) from steps").fetchone()[0] == 20
    assert db.execute("select count(*) from step_requests").fetchone()[0] == 60
    assert db.execute("select count(*) from requests").fetchone()[0] == 4
