"""bench/serve_report.py: the targets table (issue 12's fixed-row comparison, issue 13's any-config one)."""

from __future__ import annotations

from specsched.bench.serve_report import targets_table


def row(config: str, n: int, p: int, tok: float, spread: float | None = None) -> dict:
    return {"config": config, "concurrency": n, "pass": p, "tokens_per_s": tok, "num_errors": 0,
            "error": None, "compiles": 0, "spread": spread, "same_output": 1.0}  # fmt: skip


def test_targets_compare_goodput_with_the_best_fixed_row_and_with_any_other_config():
    configs = [{"name": "base", "kind": "baseline"}, {"name": "k3", "kind": "fixed"},
               {"name": "hf", "kind": "policy"}, {"name": "goodput", "kind": "default"}]  # fmt: skip
    tok = {("base", 1): 500, ("k3", 1): 800, ("hf", 1): 900, ("goodput", 1): 880,
           ("base", 64): 10000, ("k3", 64): 20000, ("hf", 64): 19000, ("goodput", 64): 19500}  # fmt: skip
    rows = [row(c, n, p, t) for (c, n), t in tok.items() for p in (1, 2)]
    text = targets_table({"configs": configs, "rows": rows})
    lines = {
        line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()[2:] if line.startswith("|")
    }
    # N = 1: +10% over k3 (met), 0.978x hf; N = 64: -2.5% vs k3 (met), 0.975x k3
    assert "| k3 800.0 | +10.0% | 500.0 | 1.76 | yes | hf 900.0 | 0.978 |" in lines["1"]
    assert "| k3 20000.0 | -2.5% | 10000.0 | 1.95 | yes | k3 20000.0 | 0.975 |" in lines["64"]


def test_paired_table_divides_each_rounds_loops_so_a_host_drift_cancels():
    from specsched.bench.serve_report import paired_table

    configs = [{"name": "base", "kind": "baseline"}, {"name": "k5", "kind": "fixed"},
               {"name": "k8", "kind": "fixed"}, {"name": "goodput", "kind": "default"},
               {"name": "goodput B", "kind": "policy"}]  # fmt: skip
    # round 2 ran on a host 2x slower for every config: goodput is 0.98x k8 in both rounds, while
    # the pooled means would compare its slow round with k8's fast one had the rounds been apart
    per_round = {"base": [500, 250], "k5": [700, 350], "k8": [1000, 500], "goodput": [980, 490],
                 "goodput B": [1100, 550]}  # fmt: skip
    rows = [dict(row(c, 4, p, sum(v) / 2), round_tok_s=v) for c, v in per_round.items() for p in (1, 2)]
    lines = [
        ln for ln in paired_table({"configs": configs, "rows": rows}).splitlines() if ln.startswith("| 4 |")
    ]
    assert lines == [
        "| 4 | goodput | k8 | 2 | -2.0% [-2.0% – -2.0%] | 2 / 2 | 1.96 [1.96 – 1.96] | – | – |",
        "| 4 | goodput B | k8 | 2 | +10.0% [+10.0% – +10.0%] | 2 / 2 | 2.20 [2.20 – 2.20] | – | – |",  # A/B
    ]
    # one round below the goal is counted as such; no round tok/s: no table
    per_round["goodput"] = [1000, 480]
    rows = [dict(row(c, 4, p, sum(v) / 2), round_tok_s=v) for c, v in per_round.items() for p in (1, 2)]
    line = next(ln for ln in paired_table({"configs": configs, "rows": rows}).splitlines()
                if ln.startswith("| 4 | goodput |"))  # fmt: skip
    assert "| -2.0% [-4.0% – +0.0%] | 1 / 2 | 1.96 [1.92 – 2.00] |" in line
    assert paired_table({"configs": configs, "rows": [row("goodput", 4, 1, 900.0)]}) == ""


def test_paired_table_sets_each_rounds_host_ms_beside_its_tok_s():
    """With the logs' host ms of each round's loops (bench/serve_drift.py round_host_ms): their ratio
    per round, and the tok/s ratio over the rounds whose two loops' host ms were within 5 %."""
    from specsched.bench.serve_report import paired_table

    configs = [{"name": "base", "kind": "baseline"}, {"name": "k8", "kind": "fixed"},
               {"name": "goodput", "kind": "default"}]  # fmt: skip
    # goodput's rounds 3 and 4 ran while its daemon's host was 20 % / 44 % slower than k8's loops
    per_round = {"base": [500] * 4, "k8": [1000] * 4, "goodput": [985, 990, 880, 780]}
    host = {"base": [1.0] * 4, "k8": [0.40, 0.40, 0.40, 0.40], "goodput": [0.40, 0.41, 0.48, 0.576]}
    rows = [dict(row(c, 4, p, sum(v) / 4), round_tok_s=v, round_host_ms=host[c])
            for c, v in per_round.items() for p in (1, 2)]  # fmt: skip
    line = next(ln for ln in paired_table({"configs": configs, "rows": rows}).splitlines()
                if ln.startswith("| 4 | goodput |"))  # fmt: skip
    assert line.endswith("| +11% [+0% – +44%] | -1.3% [-1.5% – -1.0%] (2) |"), line
    host["goodput"] = [0.6] * 4  # no round on equal terms
    rows = [dict(r, round_host_ms=host[r["config"]]) for r in rows]
    line = next(ln for ln in paired_table({"configs": configs, "rows": rows}).splitlines()
                if ln.startswith("| 4 | goodput |"))  # fmt: skip
    assert line.endswith("| +50% [+50% – +50%] | – (0) |"), line
