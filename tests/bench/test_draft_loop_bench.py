"""bench/draft_loop.py on the CPU (both ways emulated): a row per (draft, batch, k), every propose of
the loop graphs in one replay (no misses), the same drafts both ways, and its arguments checked."""

from __future__ import annotations

import pytest

from specsched.bench.draft_loop import main


def test_the_bench_times_both_ways_and_compares_their_drafts(capsys):
    argv = ["--drafts", "tiny", "tiny:2", "--batches", "1", "3", "--ks", "2", "4", "--ctx", "20",
            "--iters", "2", "--repeats", "1", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| tiny")]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (f"| {d}", b, k) for d in ("tiny", "tiny:2") for b in ("1", "3") for k in ("2", "4")
    ]
    for r in rows:
        assert r[6] == "100.0 %" and r[7] == "0 |", r  # drafts equal both ways, no propose missed the graphs
        assert float(r[3].split()[0]) > 0 and float(r[4].split()[0]) > 0


def test_a_k_below_2_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--ks", "1", "--device", "cpu"])
    assert "every k must be >= 2" in capsys.readouterr().err
