"""bench/ngram_peek.py runs end to end: a row per batch, matches on offer (the streams repeat)."""

from __future__ import annotations

from specsched.bench.ngram_peek import main, measure


def test_the_bench_times_peek_and_on_scoring_with_matches_on_offer(capsys):
    got = measure(batch=3, steps=20, seed=1)
    assert got["peek_ms"] > 0 and got["on_scoring_ms"] > 0
    assert got["mean_cap"] > 1  # half of every stream comes from a small pool: the n-gram finds matches
    main(["--batches", "1", "2", "--steps", "10", "--repeat", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line[:3] in ("| 1", "| 2")]
    assert [r.split(" | ")[0] for r in rows] == ["| 1", "| 2"]
    assert all(len(r.split(" | ")[-1].split(" / ")) == 2 for r in rows)  # each run's peek ms
