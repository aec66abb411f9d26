"""bench/decide_cost.py: the goodput decide timed against variants, plans compared on the same views."""

from __future__ import annotations

import pytest

from specsched.bench import decide_cost


def test_the_numpy_search_decides_as_the_plain_one_and_a_changed_policy_does_not():
    rows = decide_cost.time_decides(3, [{"plain_search_max_batch": 1}, {"max_k": 2}], num_views=30)
    assert [r["config"] for r in rows] == ["defaults", "plain_search_max_batch=1", "max_k=2"]
    assert rows[1]["plans_differ"] == 0  # numpy and plain Python decide alike
    assert rows[2]["plans_differ"] > 0  # a policy that may draft 2 at most does not
    assert all(r["median_us"] > 0 and r["p90_us"] >= r["median_us"] for r in rows)


def test_variants_are_parsed_as_the_option_s_type():
    assert decide_cost.parse_variant("staged_acceptance=true,max_k=5,optimism=0.5") == {
        "staged_acceptance": True, "max_k": 5, "optimism": 0.5,
    }  # fmt: skip
    with pytest.raises(ValueError, match="'nope' is not key=value of a goodput option"):
        decide_cost.parse_variant("nope=1")


def test_main_prints_a_row_per_batch_and_config(capsys):
    assert decide_cost.main(["--batches", "2", "--views", "5", "--variant", "plain_search_max_batch=1"]) == 0
    out = capsys.readouterr().out
    assert "| 2 | defaults |" in out and "| 2 | plain_search_max_batch=1 |" in out
    with pytest.raises(SystemExit):
        decide_cost.main(["--variant", "bogus"])


def test_two_acceptance_rates_need_the_estimator_and_then_plan_otherwise():
    # the defaults plan with two rates (staged_acceptance); the variants with one
    one = [{"staged_acceptance": False}, {"staged_acceptance": False, "plain_search_max_batch": 1}]
    bare = decide_cost.time_decides(4, one, num_views=20)
    assert [r["plans_differ"] for r in bare] == [0, 0, 0]  # no estimator: one rate either way
    fed = decide_cost.time_decides(4, one, num_views=20, is_estimated=True)
    assert fed[1]["plans_differ"] > 0  # two rates plan otherwise than one
    assert fed[2]["plans_differ"] == fed[1]["plans_differ"]  # ... alike on either search path
