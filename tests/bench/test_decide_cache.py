"""bench/decide_cache.py: the probe runs a real goodput decide per step and times the calls after it."""

from __future__ import annotations

from specsched.bench.decide_cache import main, probe, views


def test_probe_times_the_calls_after_a_decide_and_after_a_spin():
    row = probe(batch=4, steps=20, device="cpu")
    assert row["batch"] == 4 and row["decide_us"] > 0
    assert row["after_decide_us"] > 0 and row["after_spin_us"] > 0
    assert row["ratio"] == row["after_decide_us"] / row["after_spin_us"]


def test_views_draft_like_ngram_and_grow():
    vs = views(batch=3, steps=5)
    assert [v.batch_size for v in vs] == [3] * 5
    assert all(0 <= r.max_k <= 8 for v in vs for r in v.requests)
    assert vs[4].requests[0].context_len == vs[0].requests[0].context_len + 4


def test_cli_prints_a_row_per_batch(capsys):
    assert main(["--batches", "1", "2", "--steps", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2
