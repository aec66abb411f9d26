"""Policies on one daemon's costs (bench/same_costs.py) on real decision logs of a tiny CPU engine:
fixed k = 8 with a draft that rarely agrees, and k = 0, each log with two passes (N = 1, N = 2), as
bench=serve writes them (tests/bench/test_replay_fidelity.py records them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specsched.bench.replay_fidelity import live_rates, load_log, predicted_rates
from specsched.bench.same_costs import main, same_cost_rows
from specsched.policies.replay import policy_label
from tests.bench.test_replay_fidelity import K0, K8, record


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("same_costs")
    for name, policy in (("k8", K8), ("k0", K0)):
        record(policy, root / f"{name}.sqlite")
    torch.set_num_threads(threads)
    return root


def _pct(cell: str) -> float:
    return float(cell.rstrip("%"))


def test_both_policies_are_priced_on_the_replayed_log_and_the_live_ratio_stands_beside(logs):
    k8, k0 = load_log(str(logs / "k8.sqlite")), load_log(str(logs / "k0.sqlite"))
    rows = same_cost_rows(k8, [("k0", k0)], "k8")
    assert [r[0] for r in rows] == ["1", "2", "all"]
    own, other = predicted_rates(k8, K8), predicted_rates(k8, K0)
    live8, live0 = live_rates(k8), live_rates(k0)
    assert live0[0].tokens_per_s > 2 * live8[0].tokens_per_s  # the test means something
    for row, n in zip(rows, (1, 2, 0), strict=True):
        assert row[1] == f"k8 (`{policy_label(K8)}`)" and row[2] == f"k0 (`{policy_label(K0)}`)"
        assert float(row[3]) == pytest.approx(own[n].tokens_per_s, abs=0.06)
        assert float(row[4]) == pytest.approx(other[n].tokens_per_s, abs=0.06)
        same = own[n].tokens_per_s / other[n].tokens_per_s - 1
        live = live8[n].tokens_per_s / live0[n].tokens_per_s - 1
        assert _pct(row[5]) == pytest.approx(100 * same, abs=0.06)
        assert _pct(row[6]) == pytest.approx(100 * live, abs=0.06)
        assert _pct(row[5]) < -40 and _pct(row[6]) < -40  # k = 8 with a bad draft: far slower either way
        # k = 0 on the k = 8 log: steps that draft nothing, which that log ran only near requests' ends
        assert int(row[8]) > 50


def test_a_log_without_a_recorded_policy_is_named(logs):
    k8 = load_log(str(logs / "k8.sqlite"))
    bare = dataclasses.replace(k8, run=dataclasses.replace(k8.run, settings=dataclasses.replace(
        k8.run.settings, policy=None)))  # fmt: skip
    with pytest.raises(ValueError, match="bare: no policy recorded"):
        same_cost_rows(k8, [("bare", bare)], "k8")


def test_cli_writes_the_table_and_needs_another_log(logs, tmp_path, capsys):
    out = tmp_path / "t.md"
    k8, k0 = str(logs / "k8.sqlite"), str(logs / "k0.sqlite")
    assert main(["--replayed", k8, "--other", k0, "--out", str(out)]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out and text.startswith("Costs of `k8`'s daemon for every policy.")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "k8 (`" in line]
    assert [r.split(" | ")[0] for r in rows] == ["| 1", "| 2", "| all"]
    assert all(_pct(r.split(" | ")[5]) < -40 for r in rows)  # k = 8 far slower than k = 0 on its costs
    with pytest.raises(SystemExit):
        main(["--replayed", k8])


def test_a_serve_run_s_logs_are_found_by_its_results(logs, tmp_path, capsys):
    """--run DIR: the default config's log against the fixed and baseline rows', by the bench's file
    names, gzipped as bench/lease.sh brings them back; a config that failed is left out."""
    import gzip
    import json
    import shutil

    from specsched.bench.same_costs import run_logs

    (tmp_path / "bench").mkdir()
    (tmp_path / "logs").mkdir()
    configs = [{"name": "ngram k=8 draft", "kind": "default", "error": None},
               {"name": "no draft", "kind": "baseline", "error": None},
               {"name": "broken row", "kind": "fixed", "error": "RuntimeError: exited"},
               {"name": "an A/B row", "kind": "policy", "error": None}]  # fmt: skip
    (tmp_path / "bench" / "results.json").write_text(json.dumps({"serve": {"configs": configs}}))
    for name, src in (("ngram_k_8_draft", "k8"), ("no_draft", "k0")):
        with (
            open(logs / f"{src}.sqlite", "rb") as f,
            gzip.open(tmp_path / "logs" / f"{name}.sqlite.gz", "wb") as g,
        ):
            shutil.copyfileobj(f, g)
    replayed, others = run_logs(str(tmp_path))
    assert replayed == str(tmp_path / "logs" / "ngram_k_8_draft.sqlite")
    assert others == [str(tmp_path / "logs" / "no_draft.sqlite")]  # not the failed row, not the A/B row
    assert main(["--run", str(tmp_path)]) == 0
    assert "| 1 | ngram_k_8_draft (`" in capsys.readouterr().out
    (tmp_path / "logs" / "no_draft.sqlite").unlink()
    (tmp_path / "logs" / "no_draft.sqlite.gz").unlink()
    assert main(["--run", str(tmp_path)]) == 2
    assert "decision log of config 'no draft' is missing" in capsys.readouterr().err
    assert main(["--run", str(tmp_path / "nowhere")]) == 2
    assert "no results.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--run", str(tmp_path), "--replayed", replayed])
