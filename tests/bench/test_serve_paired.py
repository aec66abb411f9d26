"""bench/serve_paired.py: two serving logs compared per prompt and per decode step, on small hand-built
decision logs whose answers are known."""

from __future__ import annotations

import sqlite3

import pytest

from specsched.bench.serve_paired import LogError, PromptRate, main, paired_rows, prompt_rates, step_wall_ms
from specsched.engine.log_schema import SCHEMA_VERSION

SCHEMA = {
    "steps": "run_id, step, kind, start_time, batch_size, num_tokens, scorer, policy, proposer, "
    "is_synthetic, predicted_propose_ms, predicted_score_ms, predicted_verify_ms, predicted_ms, "
    "propose_ms, score_ms, verify_ms, total_ms, num_emitted, plan_info, host_ms",
    "step_requests": "run_id, step, request_id, context_len, k, num_accepted, match_bits, num_emitted, max_k",
    "requests": "run_id, request_id, client, arrival, first_token_time, finish_time, prompt_tokens, "
    "output_tokens, finish_reason, proposed, accepted",
}


def write_log(path, steps, prompts, tables=tuple(SCHEMA)):
    """A decision log: ``steps`` = [(run_id, kind, batch_size, start_time, [(request_id, num_emitted,
    k, max_k), ...])], numbered in order within each run; ``prompts`` = {request_id: prompt_tokens}
    (in every run)."""
    db = sqlite3.connect(path)
    db.execute(f"pragma user_version = {SCHEMA_VERSION}")  # a specsched log (engine/log_schema.py)
    db.execute("create table runs (run_id)")
    for t in tables:
        db.execute(f"create table {t} ({SCHEMA[t]})")
    insert = lambda t, row: db.execute(
        f"insert into {t} ({SCHEMA[t]}) values ({', '.join('?' * len(row))})", row
    )  # fmt: skip
    numbers: dict[int, int] = {}
    for run, kind, n, t, reqs in steps:
        step = numbers[run] = numbers.get(run, -1) + 1
        if "steps" in tables:
            emitted = sum(r[1] for r in reqs)
            insert(
                "steps", [run, step, kind, t, n, n, "s", "p", "ngram", 0, *[None] * 8, emitted, "{}", "{}"]
            )
        if "step_requests" in tables:
            for rid, emitted, k, max_k in reqs:
                insert("step_requests", [run, step, rid, 100, k, max(emitted - 1, 0), "", emitted, max_k])
    if "requests" in tables:
        for run in numbers:
            for rid, length in prompts.items():
                insert("requests", [run, rid, "c0", 0.0, 0.0, 1.0, length, 10, "length", 0, 0])
    db.commit()
    db.close()
    return str(path)


PROMPTS = {**{f"p40_{i}": 40 for i in range(3)}, **{f"p90_{i}": 90 for i in range(2)},
           **{f"p130_{i}": 130 for i in range(4)}}  # fmt: skip
P130 = [(f"p130_{i}", 3, 8, 8) for i in range(4)]


def ref_log(tmp_path):
    """Prompt 40: 120 request-steps of 1 token (offered 4 drafts, takes 2; p40_2 is offered none);
    prompt 90: 40 of 5 (offered 12, capped at K = 8, takes 8); prompt 130: 40 of 3. A decode step every
    2 ms, a 100 ms idle gap after the 25th; a prefill first (not counted)."""
    fill = [(rid, 1, 0, 0) for rid in ("p40_0", "p40_1", "p40_2", "p90_0")]
    steps, t = [(1, "prefill", 4, 1000.0, fill)], 1000.010
    for i in range(50):
        reqs = [("p40_0", 1, 2, 4), ("p40_1", 1, 2, 4), ("p40_2", 1, 0, 0), ("p90_0", 5, 8, 12)]
        steps.append((1, "decode", 4, t, reqs if i < 40 else P130))
        t += 0.100 if i == 25 else 0.002
    return write_log(tmp_path / "ref.sqlite", steps, PROMPTS)


def other_log(tmp_path):
    """The same prompts at 0.9x the ref's tokens per request-step, another mix: 100 request-steps each
    of prompts 40 (0.9 tokens) and 90 (4.5), 20 of prompt 130 (2 tokens: under --min-steps). A decode
    step every 2.5 ms, one 80 ms idle gap."""
    steps, t = [], 2000.0
    for j in range(55):
        p40 = 0 if j % 10 == 9 else 1
        p90 = 5 if j % 2 == 0 else 4
        reqs = [("p40_0", p40, 1, 4), ("p40_1", p40, 1, 4), ("p90_0", p90, 8, 8), ("p90_1", p90, 8, 8)]
        steps.append((1, "decode", 4, t, reqs if j < 50 else [(r, 2, k, m) for r, _, k, m in P130]))
        t += 0.080 if j == 30 else 0.0025
    return write_log(tmp_path / "other.sqlite", steps, PROMPTS)


def test_prompt_rates_per_prompt_length_decode_steps_only(tmp_path):
    ref = ref_log(tmp_path)
    rates = prompt_rates(ref, 4)
    assert rates[40] == PromptRate(40, steps=120, emitted=120, drafts=160, offered=320, with_offer=80)
    assert (rates[40].per_step, rates[40].drafts_taken) == (1.0, 0.5)
    assert rates[40].offer_share == pytest.approx(2 / 3)
    assert (rates[90].steps, rates[90].per_step, rates[90].drafts_taken) == (40, 5.0, 1.0)  # min(12, K=8)
    assert prompt_rates(ref, 4, max_k=16)[90].drafts_taken == pytest.approx(320 / 480)
    assert prompt_rates(ref, 1) == {}


def test_step_wall_ms_gaps_within_a_run_idle_dropped(tmp_path):
    steps = [
        (1, "decode", 4, 10.000, []),  # 2 ms
        (1, "decode", 4, 10.002, []),  # 3 ms, to the prefill
        (1, "prefill", 1, 10.005, []),
        (1, "decode", 4, 10.006, []),  # 100 ms: idle, dropped
        (1, "decode", 4, 10.106, []),  # the run's last step: no gap (not 4 ms to run 2's first)
        (2, "decode", 4, 10.110, []),  # 3 ms
        (2, "decode", 16, 10.113, []),
        (2, "decode", 4, 10.120, []),
    ]
    path = write_log(tmp_path / "w.sqlite", steps, {})
    assert step_wall_ms(path, 4) == pytest.approx([2.0, 3.0, 3.0])
    assert step_wall_ms(path, 16) == pytest.approx([7.0])
    assert step_wall_ms(path, 4, idle_ms=200) == pytest.approx([2.0, 3.0, 100.0, 3.0])


def test_paired_ratio_is_free_of_the_mix(tmp_path):
    ref, other = ref_log(tmp_path), other_log(tmp_path)
    (row,) = paired_rows(ref, [other], batches=[4])
    assert row["config"] == "other" and row["N"] == 4
    assert row["paired"] == [40, 90]  # prompt 130 has 20 < 30 request-steps in `other`
    assert (row["median"], row["min"], row["max"]) == pytest.approx((0.9, 0.9, 0.9))
    assert row["weighted"] == pytest.approx((120 * 0.9 + 40 * 4.5) / (120 * 1 + 40 * 5))
    # unpaired: 580 tokens / 220 request-steps vs 440 / 200, a gain from the mix alone
    assert row["unpaired"] == pytest.approx((580 / 220) / (440 / 200))
    assert row["unpaired"] > 1.15
    # drafts taken, pooled: (100 + 800 + 160) / (400 + 800 + 160) vs (160 + 320 + 320) / (320 * 3)
    assert (row["taken"], row["ref_taken"]) == pytest.approx((1060 / 1360, 800 / 960))
    assert (row["ms_mean"], row["ms_median"]) == pytest.approx((2.5, 2.5))
    assert (row["ref_ms_mean"], row["ref_ms_median"]) == pytest.approx((2.0, 2.0))
    assert row["step_ratio"] == pytest.approx(1.25)
    assert row["predicted"] == pytest.approx(0.9 / 1.25)


def test_min_steps_decides_which_prompts_pair(tmp_path):
    ref, other = ref_log(tmp_path), other_log(tmp_path)
    (row,) = paired_rows(ref, [other], batches=[4], min_steps=20)
    assert row["paired"] == [40, 90, 130]
    assert (row["median"], row["min"], row["max"]) == pytest.approx((0.9, 2 / 3, 0.9))
    (row,) = paired_rows(ref, [other], batches=[4], min_steps=101)
    assert row["paired"] == [] and row["median"] is None and row["predicted"] is None


def test_a_batch_size_without_steps_is_skipped(tmp_path):
    rows = paired_rows(ref_log(tmp_path), [other_log(tmp_path)], batches=[4, 16])
    assert "skipped" not in rows[0]
    assert rows[1] == {"config": "other", "N": 16, "skipped": "`ref`, `other`"}


def test_main_prints_the_table(tmp_path, capsys):
    ref, other = ref_log(tmp_path), other_log(tmp_path)
    assert main(["--ref", ref, "--log", other, "--batch", "4", "16"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| other | 4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["other", "4", "2", "0.900 [0.900–0.900]", "0.900", "1.198", "0.779 vs 0.833",
                     "2.50 vs 2.00", "2.50 vs 2.00", "1.250", "-28.0 %"]  # fmt: skip
    assert "Reference: `ref`." in out
    assert "- skipped `other` at N=16: no decode steps of that size in `ref`, `other`" in out


def test_missing_file_and_missing_table_are_named(tmp_path, capsys):
    ref = ref_log(tmp_path)
    missing = str(tmp_path / "nope.sqlite")
    with pytest.raises(SystemExit):
        main(["--ref", ref, "--log", missing])
    assert f"{missing}: no such file" in capsys.readouterr().err
    bare = write_log(tmp_path / "bare.sqlite", [(1, "decode", 4, 1.0, [])], {}, tables=("steps", "requests"))
    with pytest.raises(LogError, match=r"bare\.sqlite: no table 'step_requests'"):
        prompt_rates(bare, 4)
    with pytest.raises(SystemExit):
        main(["--ref", bare, "--log", ref])
    assert "no table 'step_requests'" in capsys.readouterr().err


def test_the_serve_bench_compares_each_policy_with_the_first_fixed_row(tmp_path):
    from specsched.bench.serve_paired import serve_by_prompt
    from specsched.bench.serve_report import serve_section

    ref, other = ref_log(tmp_path), other_log(tmp_path)
    missing = tmp_path / "never_started.sqlite"
    logs = {"non-speculative": ("baseline", other), "k=8": ("fixed", ref), "k=5": ("fixed", other),
            "goodput": ("default", other), "broken": ("policy", missing)}  # fmt: skip
    text = serve_by_prompt(logs, [4, 16])
    assert text.startswith("Reference: `ref`.")  # the first fixed row with a log
    body = [line for line in text.splitlines() if line.startswith("| other |")]
    assert len(body) == 1 and "| 4 |" in body[0] and "0.900" in body[0]  # goodput's log, once
    assert "skipped `other` at N=16" in text
    assert serve_by_prompt({"k=8": ("fixed", ref), "base": ("baseline", other)}, [4]) is None  # no policy
    assert serve_by_prompt({"goodput": ("default", other)}, [4]) is None  # nothing fixed to compare with
    section = serve_section({"configs": [], "rows": [], "by_prompt": text})
    assert "Tokens and time by prompt" in section and body[0] in section
