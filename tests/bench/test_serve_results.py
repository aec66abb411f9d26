"""bench/serve_results.py and the spread of bench/serve.py: the passes' tok/s on one prompt mix."""

from __future__ import annotations

import pytest

from specsched.bench.serve import add_spread
from specsched.bench.serve_results import (
    PassResult,
    RequestResult,
    same_mix_rates,
    split_interleaved,
    summarize,
)


def test_same_mix_rates_remove_the_prompt_mix_and_keep_a_real_slowdown():
    # prompt 0 runs at 1,000 tok/s and prompt 1 at 500 in both passes; pass A got mostly prompt 0
    a = {0: [30, 0.03], 1: [10, 0.02]}  # raw 40 / 0.05 = 800 tok/s
    b = {0: [10, 0.01], 1: [30, 0.06]}  # raw 40 / 0.07 = 571 tok/s
    ra, rb = same_mix_rates([a, b])
    # the pooled mix is 40 + 40 tokens: 80 / (40 / 1000 + 40 / 500) = 666.7 tok/s for both
    assert ra == pytest.approx(80 / 0.12) and rb == pytest.approx(ra)
    slower = {p: [n, s * 1.1] for p, (n, s) in b.items()}  # the same prompts, 10 % more time each
    ra, rb = same_mix_rates([a, slower])
    assert rb == pytest.approx(ra / 1.1)


def test_same_mix_rates_use_only_the_prompts_every_pass_has():
    a = {0: [10, 0.01], 1: [10, 0.02], 2: [0, 0.0]}
    b = {0: [10, 0.01], 3: [10, 0.5]}
    assert same_mix_rates([a, b]) == pytest.approx([1000, 1000])
    assert same_mix_rates([{0: [10, 0.01]}, {1: [10, 0.01]}]) is None


def test_add_spread_compares_dealt_passes_on_the_same_mix_and_keeps_the_raw_one():
    a = {0: [30, 0.03], 1: [10, 0.02]}
    b = {0: [10, 0.01], 1: [30, 0.06]}
    rows = [
        {"config": "c", "concurrency": 1, "pass": 2, "tokens_per_s": 40 / 0.07, "prompt_mix": b},
        {"config": "c", "concurrency": 1, "pass": 1, "tokens_per_s": 800.0, "prompt_mix": a},
        {"config": "d", "concurrency": 1, "pass": 1, "tokens_per_s": 100.0, "prompt_mix": None},
        {"config": "d", "concurrency": 1, "pass": 2, "tokens_per_s": 90.0, "prompt_mix": None},
    ]
    add_spread(rows)
    c1, c2, d1, d2 = rows[1], rows[0], rows[2], rows[3]
    assert c1["spread"] is None and c2["spread"] == pytest.approx(0, abs=1e-12)
    assert c2["spread_raw"] == pytest.approx(1 - (40 / 0.07) / 800)
    assert c2["same_mix_tok_s"] == pytest.approx(80 / 0.12)
    assert d2["spread"] == pytest.approx(0.1) and d2["same_mix_tok_s"] is None and d1["spread"] is None


def test_summarize_of_a_dealt_pass_keeps_each_prompts_tokens_and_busy_time():
    # one client, window [1, 5): four requests of 1 s, prompts alternating 0, 1; dealt to two passes
    reqs = [
        RequestResult(seq % 2, [1] * n, ttft_s=0.1, latency_s=1.0, sent_at=sent, chunk_at=[sent + 0.5],
                      chunk_tokens=[n], seq=seq)
        for seq, (sent, n) in enumerate([(1.0, 10), (2.0, 20), (3.0, 30), (4.0, 40)])
    ]  # fmt: skip
    res = PassResult(6.0, reqs, window_s=4, ramp_s=1, opens_at=1, closes_at=5, concurrency=1)
    (p1, p2), _ = split_interleaved(res, 2, 2, 1.0)  # seq 0, 3 -> pass 1; 1, 2 -> pass 2
    assert summarize(p1)["prompt_mix"] == {0: [10, 1.0], 1: [40, 1.0]}
    assert summarize(p2)["prompt_mix"] == {1: [20, 1.0], 0: [30, 1.0]}
    assert summarize(res)["prompt_mix"] is None  # not dealt: one pass, its own mix
