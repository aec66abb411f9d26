"""bench/round_design.py: the rounds' orders balance places and neighbours, never a config twice in a row."""

from __future__ import annotations

from collections import Counter

import pytest

from specsched.bench.round_design import round_orders


def counts(orders: list[list[str]]) -> tuple[Counter, Counter, list[str]]:
    seq = [c for order in orders for c in order]
    return Counter((c, i) for order in orders for i, c in enumerate(order)), Counter(zip(seq, seq[1:])), seq


@pytest.mark.parametrize("seed", ["0:4", "0:16", "3:64", "7:1"])
def test_three_configs_over_six_rounds_take_each_place_twice_and_follow_each_other_evenly(seed):
    """The verdict preset's design: 3 configs, 6 rounds. Each config each place twice; each ordered
    pair of configs neighbours 2-3 times (17 neighbourships over 6 pairs), across rounds' ends too; a
    rotation of one order (ABC, BCA, CAB, ...) would have A after C in every round and never after B."""
    names = ["non-speculative", "k8", "goodput"]
    orders = round_orders(names, 6, seed)
    place, after, seq = counts(orders)
    assert all(sorted(o) == sorted(names) for o in orders)
    assert all(place[(c, i)] == 2 for c in names for i in range(3)), place
    assert all(2 <= after[(a, b)] <= 3 for a in names for b in names if a != b), after
    assert all(a != b for a, b in zip(seq, seq[1:]))
    assert round_orders(names, 6, seed) == orders  # reproducible


@pytest.mark.parametrize("m, num_rounds", [(1, 3), (2, 5), (3, 4), (4, 4), (5, 10), (6, 3), (9, 6)])
def test_any_size_never_runs_a_config_twice_in_a_row_and_spreads_places(m, num_rounds):
    names = [f"c{i}" for i in range(m)]
    for seed in ("0:1", "1:4"):
        orders = round_orders(names, num_rounds, seed)
        place, _, seq = counts(orders)
        assert len(orders) == num_rounds and all(sorted(o) == names for o in orders)
        if m > 1:
            assert all(a != b for a, b in zip(seq, seq[1:])), orders
        if 3 <= m <= num_rounds:  # enough rounds for every place: each config took each at least once
            assert min(place[(c, i)] for c in names for i in range(m)) >= 1, place
    if m >= 3:  # the seed picks the design
        assert len({tuple(map(tuple, round_orders(names, num_rounds, f"{s}:4"))) for s in range(6)}) > 1
    assert round_orders(names, 0, "0:1") == []


def test_five_configs_over_ten_rounds_are_balanced_as_a_williams_design():
    names = list("ABCDE")
    place, after, _ = counts(round_orders(names, 10, "0:4"))
    assert all(place[(c, i)] == 2 for c in names for i in range(5)), place
    assert all(2 <= after[(a, b)] <= 3 for a in names for b in names if a != b), after
