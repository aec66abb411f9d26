"""Runs of plain decode steps in the replay (policies/replay_runs.py): the engine's rules as a pure
function, and replays of live CPU runs with runs that reproduce the live record counts."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from specsched.daemon.log import LogConfig, LogWriter
from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from specsched.engine.engine import Engine
from specsched.engine.multi_step import num_decode_steps
from specsched.engine.records import StepRecord
from specsched.engine.request import Request, SamplingParams
from specsched.policies.registry import build_policy
from specsched.policies.replay import recorded_result, replay, simulate
from specsched.policies.replay_bits import complete_bits
from specsched.policies.replay_costs import refit_costs
from specsched.policies.replay_log import load_run
from specsched.policies.replay_runs import RunRules, run_length


def test_run_rules_from_a_scheduler_node():
    assert RunRules.from_scheduler(None).is_off and RunRules.from_scheduler({"max_num_seqs": 4}).is_off
    rules = RunRules.from_scheduler(
        {"decode_steps": 8, "decode_steps_max_batch": 1, "plain_decode_steps": 8, "plain_decode_ms": 8.0}
    )
    assert rules == RunRules(8, 1, 8, 8.0) and not rules.is_off
    with pytest.raises(ValueError, match="decode_steps and plain_decode_steps >= 1"):
        RunRules(decode_steps=0)


def test_plain_alone_runs_capped_by_tokens_left_and_by_ms():
    rules = RunRules(plain_decode_steps=8, plain_decode_ms=8.0)
    assert run_length(rules, [0], [100], "none", 8, False, forward_ms=0.9) == 8
    assert run_length(rules, [0], [3], "none", 8, False, forward_ms=0.9) == 3  # alone: its tokens left
    assert run_length(rules, [0], [100], "none", 8, False, forward_ms=2.0) == 4  # 8 ms / 2 ms a forward
    assert run_length(rules, [0], [100], "none", 8, False, forward_ms=None) == 1  # not measured yet
    assert run_length(rules, [0], [100], "none", 8, False, forward_ms=30.0) == 1  # a 7B forward
    assert run_length(rules, [0], [100], "none", 8, True, forward_ms=0.9) == 1  # one waits: no run
    assert run_length(rules, [0, 0], [100, 100], "none", 8, False, forward_ms=0.9) == 1  # not alone
    assert run_length(rules, [5], [100], "ngram", 0, False, forward_ms=0.9) == 8  # spec.max_k 0
    assert run_length(rules, [5], [100], "ngram", 8, False, forward_ms=0.9) == 1  # it can draft


def test_decode_steps_runs_by_batch_waiting_and_offers():
    any_batch, alone = RunRules(decode_steps=4), RunRules(decode_steps=4, decode_steps_max_batch=1)
    assert run_length(any_batch, [3, 2], [50, 50], "ngram", 8, True) == 4  # any batch, waiting or not
    assert run_length(any_batch, [3, 0], [50, 50], "ngram", 8, False) == 1  # a k = 0 for lack of a match
    assert run_length(any_batch, [3, 2], [2, 50], "ngram", 8, False) == 4  # a batch runs on past a stop
    assert run_length(alone, [3, 2], [50, 50], "draft", 8, False) == 1
    assert run_length(alone, [3], [50], "draft", 8, True) == 1
    assert run_length(alone, [3], [2], "draft", 8, False) == 2
    assert run_length(RunRules(), [3], [50], "draft", 8, False) == 1
    capped = RunRules(decode_steps=8, decode_steps_max_batch=1, plain_decode_ms=8.0)
    assert run_length(capped, [3], [50], "draft", 8, False, forward_ms=2.0) == 4  # alone: ~8 ms
    assert run_length(capped, [3], [50], "draft", 8, False, forward_ms=None) == 1
    assert run_length(RunRules(decode_steps=8, plain_decode_ms=8.0), [3, 3], [50, 50], "draft", 8, False) == 8
    with pytest.raises(ValueError, match="one offer per request"):
        run_length(any_batch, [3], [50, 50], "ngram", 8, False)


@pytest.mark.parametrize("seed", range(20))
def test_run_length_agrees_with_the_engines_num_decode_steps(seed):
    """For runs by ``decode_steps`` (any batch), the replay's rule and the engine's
    :func:`num_decode_steps` give the same forwards on random batches of greedy requests."""
    rng = random.Random(seed)
    b = rng.randint(1, 4)
    offers = [rng.choice([0, 0, 2, 8]) for _ in range(b)]
    left = [rng.randint(1, 20) for _ in range(b)]
    proposer = rng.choice(["ngram", "draft", "none"])
    reqs = []
    for i, n in enumerate(left):  # 10 tokens out, n left to emit
        reqs.append(Request(f"r{i}", [1] * 5, SamplingParams(max_tokens=10 + n)))
        reqs[-1].output_ids = [1] * 10
    engine = num_decode_steps(reqs, [0] * b, offers, [proposer] * b, 6, max_model_len=4096)
    assert run_length(RunRules(decode_steps=6), offers, left, proposer, 8, False) == engine


# ---- replays of live CPU runs -----------------------------------------------------------------------

MAX_TOKENS = 30


def live_log(path, scheduler: SchedulerConfig, proposer: str, one_at_a_time: bool) -> list[StepRecord]:
    """Six greedy requests on the tiny model, logged to ``path`` (client "c0"), all queued at once or
    (``one_at_a_time``) each added when the last finished; returns the step records."""
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=scheduler,
        spec=SpecConfig(proposer=proposer, scorers=["batch_expansion", "mqa"], max_k=4),
        policy={"name": "fixed", "k": 0, "scorer": "mqa"},
    )  # fmt: skip
    engine = Engine(cfg)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(4, 12))] for _ in range(6)]
    records: list[StepRecord] = []
    log = LogWriter(LogConfig(path=str(path), flush_interval_s=0.05))
    log.start_run(dataclasses.asdict(cfg), model="tiny", device="cpu", version="test")

    def on_step(rec: StepRecord) -> None:
        records.append(rec)
        log.write_step(rec)

    engine.on_step = on_step
    greedy = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    reqs = [Request(f"r{i}", p, SamplingParams(**greedy)) for i, p in enumerate(prompts)]
    queue = list(reqs)
    while queue or engine.has_unfinished:
        if queue and (not one_at_a_time or not engine.has_unfinished):
            engine.add_request(queue.pop(0))
            continue
        engine.step()
    for r in reqs:
        log.write_request(
            r.request_id, client="c0" if one_at_a_time else None, arrival=r.arrival_time,
            first_token_time=r.first_token_time, finish_time=time.time(), prompt_tokens=r.num_prompt_tokens,
            output_tokens=r.num_output_tokens, finish_reason=r.finish_reason, proposed=0, accepted=0,
        )  # fmt: skip
    log.close()
    return records


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_replay_runs_a_non_speculative_request_alone_as_the_engine_did(tmp_path):
    """plain_decode_steps: proposer none, each request alone (one client): the engine ran runs of 8;
    the replay of its own policy runs the same records and forwards, and without the run rules one
    forward a record."""
    sched = SchedulerConfig(max_num_seqs=2, plain_decode_steps=8, plain_decode_ms=None)
    records = live_log(tmp_path / "n.sqlite", sched, "none", one_at_a_time=True)
    decode = [r for r in records if r.kind == "decode"]
    assert sum(r.num_decode_steps > 1 for r in decode) >= 6  # the test means something: runs happened
    run = load_run(tmp_path / "n.sqlite")
    assert run.settings.runs.plain_decode_steps == 8 and run.settings.proposer == "none"
    costs, bits = refit_costs(run), complete_bits(run)
    policy = build_policy(run.settings.policy)
    res = simulate(run, bits, policy, costs, "own", closed_loop=True)
    assert res.num_steps == len(decode)
    assert res.num_run_steps == sum(r.num_decode_steps for r in decode if r.num_decode_steps > 1)
    assert res.num_decode_tokens == sum(r.output_len - 1 for r in run.requests)
    one_by_one = simulate(run, bits, build_policy(run.settings.policy), costs, "off", closed_loop=True,
                          runs=RunRules())  # fmt: skip
    assert one_by_one.num_run_steps == 0 and one_by_one.num_steps == res.num_decode_tokens
    # a run is priced as a run (the single-step models corrected by the log's runs): the replay's ms
    # are the recorded row's prediction for the same records
    recorded = recorded_result(run, costs)
    assert recorded.num_run_steps == res.num_run_steps
    assert res.predicted_ms == pytest.approx(recorded.predicted_ms, rel=0.02)


def test_replay_runs_decode_steps_at_any_batch_as_the_engine_did(tmp_path):
    """decode_steps=4 at any batch, the draft proposer declined (fixed k = 0): the replay of the log's
    own policy reproduces its records and run forwards; the recorded row prices runs as runs."""
    sched = SchedulerConfig(max_num_seqs=2, decode_steps=4, decode_steps_max_batch=None)
    records = live_log(tmp_path / "d.sqlite", sched, "draft", one_at_a_time=False)
    decode = [r for r in records if r.kind == "decode"]
    assert sum(r.num_decode_steps == 4 for r in decode) >= 10
    report = replay(load_run(tmp_path / "d.sqlite"), [])
    recorded, own = report.rows[:2]  # the log as it is, its own policy replayed
    assert (own.num_steps, own.num_run_steps) == (recorded.num_steps, recorded.num_run_steps)
    assert recorded.num_run_steps == sum(r.num_decode_steps for r in decode if r.num_decode_steps > 1)
    assert own.predicted_ms == pytest.approx(recorded.predicted_ms, rel=0.02)
