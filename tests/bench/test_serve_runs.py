"""bench/serve_runs.py: issue 12's targets over several bench=serve runs (median and range per N)."""

from __future__ import annotations

import json

import pytest

from specsched.bench.serve_runs import load_serve, main, pool_targets, pool_tokens, runs_table, token_rows

CONFIGS = [{"name": "base", "kind": "baseline"}, {"name": "k8", "kind": "fixed"},
           {"name": "goodput", "kind": "default"}]  # fmt: skip


def result(tok: dict[tuple[str, int], float], spread: float = 0.01) -> dict:
    """A serve result with two passes of each (config, N) at ``tok`` tok/s."""
    rows = [
        {"config": c, "concurrency": n, "pass": p, "tokens_per_s": t, "num_errors": 0, "error": None,
         "compiles": 0, "spread": spread if p == 2 else None}
        for (c, n), t in tok.items() for p in (1, 2)
    ]  # fmt: skip
    return {"configs": CONFIGS, "rows": rows}


def runs() -> list[dict]:
    # N = 4: goodput −5 % then +3 % against k8 (median −1 %: met on the medians, 1 of 2 runs met);
    # N = 16: −4 % then −3.5 % (median −3.75 %: not met, no run met)
    one = result({("base", 4): 1000, ("k8", 4): 2000, ("goodput", 4): 1900,
                  ("base", 16): 3000, ("k8", 16): 5000, ("goodput", 16): 4800})  # fmt: skip
    two = result({("base", 4): 1000, ("k8", 4): 2000, ("goodput", 4): 2060,
                  ("base", 16): 3000, ("k8", 16): 5000, ("goodput", 16): 4825}, spread=0.04)  # fmt: skip
    return [one, two]


def test_pool_takes_each_runs_ratio_and_their_median_and_range():
    by_n = {p["concurrency"]: p for p in pool_targets(runs())}
    four, sixteen = by_n[4], by_n[16]
    assert four["vs_best"] == pytest.approx([-0.05, 0.03])
    assert four["vs_best_spread"] == pytest.approx((-0.01, -0.05, 0.03))
    assert four["vs_base_spread"] == pytest.approx((1.98, 1.9, 2.06))
    assert (four["num_met"], four["num_runs"], four["met"]) == (1, 2, True)
    assert sixteen["vs_best_spread"][0] == pytest.approx(-0.0375)
    assert (sixteen["num_met"], sixteen["num_runs"], sixteen["met"]) == (0, 2, False)


def test_a_run_without_an_n_is_left_out_of_that_n():
    one, two = runs()
    two["rows"] = [r for r in two["rows"] if r["concurrency"] == 4]
    sixteen = {p["concurrency"]: p for p in pool_targets([one, two])}[16]
    assert sixteen["vs_best"][1] is None and sixteen["num_runs"] == 1
    assert sixteen["vs_best_spread"] == pytest.approx((-0.04, -0.04, -0.04))


def test_table_lists_the_runs_and_a_row_per_n():
    text = runs_table([dict(r, label=f"run {i}") for i, r in enumerate(runs())])
    assert "| 2 | run 1 | 4.0 % | 0 |" in text
    assert "| 4 | -5.0 % / +3.0 % | -1.0 % [-5.0 %, +3.0 %] | 1.98 [1.90, 2.06] | 1 / 2 | yes |" in text
    assert "| 16 | -4.0 % / -3.5 % |" in text and "| 0 / 2 | **no** |" in text


def test_load_reads_a_run_directory_or_file_and_names_what_is_wrong(tmp_path, capsys):
    (tmp_path / "bench").mkdir()
    path = tmp_path / "bench" / "results.json"
    path.write_text(json.dumps({"date": "2026-12-07 22:27", "device": "H100", "serve": runs()[0]}))
    assert load_serve(tmp_path)["label"] == "2026-12-07 22:27 H100"
    assert load_serve(path)["rows"] == runs()[0]["rows"]
    with pytest.raises(ValueError, match="does not exist"):
        load_serve(tmp_path / "bench" / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no results.json"):
        load_serve(tmp_path / "empty")
    (tmp_path / "other.json").write_text(json.dumps({"scorers": []}))
    with pytest.raises(ValueError, match="no bench=serve result"):
        load_serve(tmp_path / "other.json")
    out = tmp_path / "runs.md"
    assert main([str(tmp_path), str(path), "--out", str(out)]) == 0
    assert "| 4 | -5.0 % / -5.0 % |" in out.read_text()
    assert main([str(tmp_path / "other.json")]) == 2
    assert "no bench=serve result" in capsys.readouterr().err


def paired(n: int, weighted: float, step_ratio: float, config: str = "goodput") -> dict:
    return {"config": config, "N": n, "weighted": weighted, "step_ratio": step_ratio}


def test_tokens_per_request_step_pool_from_each_runs_rows():
    one, two = runs()
    one["by_prompt_rows"] = [paired(4, 0.96, 1.01), paired(16, 0.99, 1.03), paired(4, 1.2, 1.0, "other")]
    two["by_prompt_rows"] = [paired(4, 0.98, 0.95), {"config": "goodput", "N": 16, "skipped": "`k8`"}]
    by_n = {p["concurrency"]: p for p in pool_tokens([one, two])}
    assert by_n[4]["tokens"] == [0.96, 0.98] and by_n[4]["tokens_spread"] == pytest.approx((0.97, 0.96, 0.98))
    assert by_n[4]["steps_spread"] == pytest.approx((0.98, 0.95, 1.01))
    assert by_n[16]["tokens"] == [0.99, None]  # skipped in run 2; another config's row is not goodput's
    text = runs_table([one, two])
    assert "| 4 | 0.960 / 0.980 | 0.970 [0.960, 0.980] | 1.010 / 0.950 | 0.980 [0.950, 1.010] |" in text


def test_tokens_come_from_a_runs_gzipped_logs_when_its_results_lack_them(tmp_path):
    import gzip

    from tests.bench.test_serve_paired import other_log, ref_log

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    for path, name in ((ref_log(tmp_path), "k8"), (other_log(tmp_path), "goodput")):
        with open(path, "rb") as src, gzip.open(logs / f"{name}.sqlite.gz", "wb") as dst:
            dst.write(src.read())
    res = dict(runs()[0], run_dir=str(tmp_path / "run"))  # N = 4 and 16; the logs have N = 4 only
    rows = token_rows(res)
    assert [r["N"] for r in rows] == [4] and rows[0]["weighted"] == pytest.approx(0.9)
    assert token_rows(dict(runs()[0], run_dir=str(tmp_path / "nowhere"))) == []
