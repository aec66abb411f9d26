"""The ``goodput`` policy's scorer pruning: a decide searches only the scorers that were within
``prune_below`` of the best at the last full search, and decides as the unpruned search does."""

from __future__ import annotations

import numpy as np
import pytest

from specsched.policies.goodput import GoodputConfig, GoodputPolicy
from tests.policies.test_goodput import machine, make_view, trained

SCORERS = ("batch_expansion", "mqa")


@pytest.fixture(scope="module")
def far_behind():
    """Cost models of a machine where the eager MQA scorer costs 100 ms more a step (~0.2x the
    goodput of batch expansion)."""
    return trained(machine(mqa_bias=100.0), scorers=SCORERS)


def views(n: int, batch: int = 12, seed: int = 0, acc=(0.5, 0.95)):
    rng = np.random.default_rng(seed)
    return [
        make_view(
            rng.uniform(*acc, batch).tolist(), ctx=rng.integers(100, 3000, batch).tolist(), scorers=SCORERS
        )
        for _ in range(n)
    ]


def test_searches_only_the_contenders_and_decides_as_the_full_search(far_behind):
    pruned, full = GoodputPolicy(), GoodputPolicy(GoodputConfig(prune_below=0.0))
    searched = []
    for view in views(40, acc=(0.85, 0.98)):  # every plan drafts
        a, b = pruned.decide(view, far_behind), full.decide(view, far_behind)
        assert (a.k, a.scorer) == (b.k, b.scorer) and any(a.k)
        assert b.info["num_scorers_searched"] == 2
        searched.append(a.info["num_scorers_searched"])
        if a.info["num_scorers_searched"] == 1:
            assert list(a.info["scorer_goodput"]) == ["batch_expansion"]
        assert a.info["k0_scorer"] == b.info["k0_scorer"]  # a carry drafting nothing: the full search's
    # a full search on the first decide and on every 16th after it, the contender alone between them
    assert searched == [2 if i % 16 == 0 else 1 for i in range(40)]


def test_a_plain_decode_step_searches_every_scorer(far_behind):
    policy = GoodputPolicy(GoodputConfig(acceptance_z=0.0))
    for view in views(6, acc=(0.0, 0.02)):  # nothing worth drafting: k = 0 for everyone
        plan = policy.decide(view, far_behind)
        assert not any(plan.k)
        assert plan.info["num_scorers_searched"] == 2


def test_close_scorers_are_never_pruned():
    costs = trained(machine(mqa_bias=8.0), scorers=SCORERS)  # the two within 0.69-0.99x of each other
    policy = GoodputPolicy()
    assert all(policy.decide(v, costs).info["num_scorers_searched"] == 2 for v in views(10))


def test_a_new_scorer_set_gets_a_full_search(far_behind):
    policy = GoodputPolicy()
    policy.decide(views(1)[0], far_behind)
    assert policy.decide(views(1)[0], far_behind).info["num_scorers_searched"] == 1
    view = views(1)[0]
    view.scorers = ["mqa", "batch_expansion"]
    assert policy.decide(view, far_behind).info["num_scorers_searched"] == 2


@pytest.mark.parametrize(
    "options, match",
    [({"prune_below": 1.0}, "prune_below"), ({"full_search_interval": 0}, "full_search_interval")],
)
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        GoodputConfig(**options)
