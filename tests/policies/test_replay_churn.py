"""The replay's churn residual (policies/replay_churn.py): steps classed by how the decode batch changed,
the mean residual per (batch-size group, class) fitted on a log, and the replay charging it per step."""

from __future__ import annotations

import dataclasses

import pytest

from specsched.policies.registry import build_policy
from specsched.policies.replay import complete_bits, simulate
from specsched.policies.replay_churn import GROUPS, MIN_STEPS, ChurnResidual, churn_class, group_of
from specsched.policies.replay_costs import refit_costs
from specsched.policies.replay_log import load_run

from .test_replay import CONFIG, decode_step, write_batching_log, write_log


def test_churn_class():
    assert churn_class(None, {"a"}) == "same"
    assert churn_class({"a", "b"}, {"a", "b"}) == "same"
    assert churn_class({"a", "b"}, {"a"}) == "left"
    assert churn_class({"a"}, {"a", "b"}) == "join"
    assert churn_class({"a", "b"}, {"a", "c"}) == "left"  # both: left first
    assert [group_of(b) for b in (1, 2, 4, 5, 16, 17, 64, 65, 500)] == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert len(GROUPS) == 5


def rotating_steps(num_requests: int, length: int, slots: int = 2, context: int = 10):
    """Decode steps of requests ``length`` output tokens long (every draft rejected: one token per step),
    ``slots`` at a time, the next joining as one finishes; -> (steps, requests, each step's class)."""
    steps, classes, live, pos, last = [], [], [f"r{i}" for i in range(slots)], {}, None
    queue = [f"r{i}" for i in range(slots, num_requests)]
    while live:
        ids = set(live)
        classes.append(churn_class(last, ids))
        last = ids
        steps.append(decode_step(len(steps), [(r, context + pos.get(r, 0), 1, 0) for r in live]))
        for r in live:
            pos[r] = pos.get(r, 0) + 1
        live = [r for r in live if pos[r] < length - 1]
        while queue and len(live) < slots:
            live.append(queue.pop(0))
    return steps, [(f"r{i}", context, length) for i in range(num_requests)], classes


def test_the_residual_is_the_mean_per_group_and_class_and_thin_cells_add_nothing():
    steps, _, classes = rotating_steps(80, 4, slots=3)
    extra = {"left": 2.0, "join": -0.5, "same": 0.25}
    churn = ChurnResidual.fit(steps, lambda rec: 3.0, lambda rec: 3.0 + extra[classes[rec.step]])
    counts = {c: classes.count(c) for c in extra}
    print(counts)
    for c, want in extra.items():  # every step here has 2-3 requests: group 2-4
        assert churn.ms(3, c) == (pytest.approx(want) if counts[c] >= MIN_STEPS else 0.0), c
    assert counts["left"] >= MIN_STEPS and counts["same"] >= MIN_STEPS
    assert churn.ms(1, "left") == 0.0  # no batch-1 steps
    assert churn.table()[("2-4", "left")] == (counts["left"], pytest.approx(2.0))
    # a thin cell: MIN_STEPS - 1 steps of one class add nothing
    few = ChurnResidual.fit(steps[: MIN_STEPS + 5], lambda rec: 3.0, lambda rec: 9.0)
    for c in extra:
        n = classes[: MIN_STEPS + 5].count(c)
        assert few.ms(3, c) == (6.0 if n >= MIN_STEPS else 0.0)


def test_refit_finds_a_planted_cost_of_steps_after_a_finish(tmp_path):
    """Steps right after a request finished run 6 ms longer: the refit's churn residual says so (the
    linear models cannot, the shapes being alike), and without churn there is none."""
    steps, requests, classes = rotating_steps(90, 4)
    steps = [dataclasses.replace(s, total_ms=s.total_ms + (6.0 if c == "left" else 0.0))
             for s, c in zip(steps, classes)]  # fmt: skip
    assert classes.count("left") >= MIN_STEPS and classes.count("same") >= MIN_STEPS
    write_log(tmp_path / "c.sqlite", CONFIG, steps, requests)
    run = load_run(tmp_path / "c.sqlite")
    costs = refit_costs(run)
    assert costs.churn.ms(2, "left") - costs.churn.ms(2, "same") == pytest.approx(6.0, abs=0.3)
    assert refit_costs(run, churn=False).churn is None


def test_the_replay_charges_each_step_its_classes_residual(tmp_path):
    write_batching_log(tmp_path / "b.sqlite")  # steps 1-2 r0+r1, r1 done; 3-4 r0+r2, r0 done; 5 r2+r3
    run = load_run(tmp_path / "b.sqlite")
    bits, policy = complete_bits(run), {"name": "fixed", "k": 3, "scorer": "mqa"}
    costs = refit_costs(run, churn=False)
    plain = simulate(run, bits, build_policy(policy), costs, "plain")
    costs.churn = ChurnResidual(
        sums={(g, c): v * MIN_STEPS for g in range(len(GROUPS)) for c, v in (("left", 10.0), ("join", 1e3))},
        counts={(g, c): MIN_STEPS for g in range(len(GROUPS)) for c in ("left", "join")},
    )
    charged = simulate(run, bits, build_policy(policy), costs, "churn")
    diffs = [round(b.predicted_ms - a.predicted_ms, 6) for a, b in zip(plain.trace, charged.trace)]
    assert diffs == [0.0, 0.0, 10.0, 0.0, 10.0]  # r1 gone at step 3 (r2 in: left first), r0 at 5
    assert charged.predicted_ms == pytest.approx(plain.predicted_ms + 20.0)
