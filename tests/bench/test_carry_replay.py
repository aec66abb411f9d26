"""bench/carry_replay.py: goodput replayed as the engine's planner runs it (decides every few steps,
plans carried between), on a decision log written by the real LogWriter (hand-built steps)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from specsched.bench.carry_replay import CarriedPolicy, carry_rows, main
from specsched.policies.goodput import GoodputPolicy
from specsched.policies.replay import simulate
from specsched.policies.replay_bits import complete_bits
from specsched.policies.replay_costs import refit_costs
from specsched.policies.replay_log import load_run

_path = Path(__file__).parents[1] / "policies" / "test_replay.py"
_spec = importlib.util.spec_from_file_location("replay_helpers", _path)
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    """Two requests at a time (max_num_seqs 2) of 30 output tokens, drafts of 3 with 0-3 accepted in
    turn; a third request joins when the first finishes."""
    steps, pos, step = [], {"a": 0, "b": 0}, 0
    live, queue = ["a", "b"], ["c"]
    while live:
        reqs = []
        for r in live:
            acc = (step + len(r)) % 4 if pos[r] < 25 else 0
            k = 3 if pos[r] < 25 else 0
            reqs.append((r, 10 + pos[r], k, min(acc, k)))
        steps.append(_helpers.decode_step(step, reqs))
        step += 1
        for r, _, _, a in reqs:
            pos[r] += a + 1
        for r in [r for r in live if pos[r] >= 29]:
            live.remove(r)
            if queue:
                nxt = queue.pop(0)
                live.append(nxt)
                pos[nxt] = 0
    path = tmp_path_factory.mktemp("carry") / "log.sqlite"
    config = {**_helpers.CONFIG, "scheduler": {"max_num_seqs": 2}}
    _helpers.write_log(path, config, steps, [(r, 10, 30) for r in ("a", "b", "c")])
    return path


def replayed(path, policy):
    run = load_run(path)
    return simulate(run, complete_bits(run, 0), policy, refit_costs(run), "x", None), policy


def test_one_step_a_plan_decided_on_the_step_is_the_plain_replay(log):
    plain, _ = replayed(log, GoodputPolicy())
    carried, policy = replayed(log, CarriedPolicy(GoodputPolicy(), 1, 8, "step"))
    assert (carried.num_tokens, carried.num_steps, carried.num_drafts) == (
        plain.num_tokens, plain.num_steps, plain.num_drafts
    )  # fmt: skip
    assert carried.predicted_ms == pytest.approx(plain.predicted_ms)
    assert policy.num_decides == carried.num_steps


def test_a_plan_runs_its_interval_and_a_decide_ahead_offers_max_k(log):
    res, policy = replayed(log, CarriedPolicy(GoodputPolicy(), 4, 8, "ahead"))
    assert res.num_steps > 8
    # a decide every 4 steps, plus one where the batch changed too much to carry (c joining)
    assert -(-res.num_steps // 4) <= policy.num_decides <= -(-res.num_steps // 4) + 2
    assert set(policy.held[2].values()) == {8}  # the caps the decide saw: every request offered 8


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="offer must be one of ahead, step, got 'later'"):
        CarriedPolicy(GoodputPolicy(), 1, 8, "later")
    with pytest.raises(ValueError, match="interval must be >= 1, got 0"):
        CarriedPolicy(GoodputPolicy(), 0, 8, "step")


def test_the_table_has_a_row_per_level_and_config(log, capsys):
    rows = carry_rows(str(log), [1, 3], ["ahead", "step"], 2)
    assert [r[1] for r in rows][:3] == [
        "fixed k=2 mqa",
        "goodput, every step",
        "goodput, 1 steps a plan, decided ahead",
    ]
    levels = sorted({r[0] for r in rows})
    assert levels == ["1", "4"]  # two at a time (level 4), then the last request alone (level 1)
    assert len(rows) == len(levels) * (2 + 4)
    assert main([str(log), "--intervals", "3", "--offers", "step", "--fixed-k", "0"]) == 0
    out = capsys.readouterr().out
    assert "goodput, 3 steps a plan, decided on the step" in out and "fixed k" not in out
    assert main([str(log), "--intervals", "3", "--offers", "step", "--max-joined", "0.125", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "up to 0.125 of the batch new" in out and "up to 0.5 of the batch new" in out
    with pytest.raises(SystemExit):
        main([str(log), "--max-joined", "2"])
    assert "every --max-joined share must be in [0, 1]" in capsys.readouterr().err


def test_decide_ms_charges_goodput_s_decides(log):
    rows = carry_rows(str(log), [4], ["step"], 2, decide_ms=5.0)
    by = {(r[0], r[1]): r for r in rows}
    level = rows[0][0]
    fixed, every, carried = (by[(level, c)] for c in (
        "fixed k=2 mqa", "goodput, every step", "goodput, 4 steps a plan, decided on the step"))  # fmt: skip
    assert fixed[6] == fixed[2]  # not goodput: nothing charged
    assert float(every[6]) < float(every[2]) and float(carried[6]) < float(carried[2])
    # a decide every step pays more of it than one every 4 steps
    assert float(every[6]) / float(every[2]) < float(carried[6]) / float(carried[2])
