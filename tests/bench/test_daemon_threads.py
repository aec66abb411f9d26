"""bench/daemon_threads.py on a real tiny daemon with a real SQLite log: the threads' CPU per chunk."""

from __future__ import annotations

import os

import pytest

from specsched.bench.daemon_threads import main, measure


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_the_daemons_threads_are_timed_per_chunk(tmp_path):
    row = measure(streams=2, seconds=2.0, log_dir=tmp_path)
    assert row["streams"] == 2 and row["chunks_per_s"] > 0
    # every thread did work while the streams ran: the IO thread sent chunks, the writer wrote rows
    for key in ("engine", "io", "log", "process"):
        assert row[f"{key}_us"] > 0 and 0 < row[f"{key}_share"] < 4, (key, row)
    assert row["process_share"] >= row["engine_share"]
    assert (tmp_path / "threads_2.sqlite").stat().st_size > 0


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        main(["--streams", "0"])
