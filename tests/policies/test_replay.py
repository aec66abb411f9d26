"""Offline replay: match bits from a log, the simulation, and its fidelity against a live run."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import sqlite_utils
import torch

from specsched.daemon.log import SCHEMA_SQL, LogConfig, LogFormatError, LogWriter
from specsched.engine.config import (
    CacheConfig,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from specsched.engine.engine import Engine
from specsched.engine.records import StepRecord, StepRequestRecord
from specsched.engine.request import Request, SamplingParams
from specsched.policies.registry import build_policy
from specsched.policies.replay import ReplayOptions, policy_label, replay, simulate
from specsched.policies.replay_bits import complete_bits
from specsched.policies.replay_costs import refit_costs
from specsched.policies.replay_log import ReplayError, RunSettings, load_run
from specsched.policies.replay_runs import RunRules
from specsched.proposers.ngram import ngram_lookup

# ---- hand-built logs ------------------------------------------------------------------------------


def write_log(path, config: dict, steps: list[StepRecord], requests: list[tuple]) -> None:
    """A log written by the real LogWriter: ``requests`` are (id, prompt_tokens, output_tokens[,
    prompt_hash])."""
    with LogWriter(LogConfig(path=str(path), flush_interval_s=0.05)) as log:
        log.start_run(config, model="hand", device="cpu", version="test")
        for rec in steps:
            log.write_step(rec)
        for rid, prompt, out, *digest in requests:
            log.write_request(
                rid, client=None, arrival=1.0, first_token_time=1.0, finish_time=2.0, prompt_tokens=prompt,
                output_tokens=out, finish_reason="length", proposed=0, accepted=0,
                prompt_hash=digest[0] if digest else None,
            )  # fmt: skip


def decode_step(step: int, reqs: list[tuple[str, int, int, int]], scorer: str = "mqa", ms: float = 5.0):
    """A decode step record; ``reqs`` are (id, context_len, k, num_accepted)."""
    rows = [StepRequestRecord(r, c, k, a, "1" * a + ("0" if a < k else "")) for r, c, k, a in reqs]
    return StepRecord(
        step, "decode", 1.5, len(rows), sum(k + 1 for _, _, k, _ in reqs), scorer, "fixed", "draft",
        propose_ms=1.0, score_ms=ms, verify_ms=0.5, total_ms=ms + 2.0,
        num_emitted=sum(a + 1 for _, _, _, a in reqs), requests=rows,
    )  # fmt: skip


CONFIG = {
    "proposer": {"name": "draft", "max_k": 8},
    "scorer": {"names": ["mqa"]},
    "scheduler": {"max_num_seqs": 2},
    "cache": {"block_size": 4, "num_blocks": None},
    "policy": {"name": "fixed", "k": 1, "scorer": "mqa"},
}


def test_match_bits_are_read_off_the_steps(tmp_path):
    # prompt 5: step 0 is the prefill; then s=0: k=3, a=1 -> bits 1:1, 2:0; s=2: k=2, a=2 -> bits 3, 4
    # are 1 and index 5 is the bonus token (unknown); s=5: k=1, a=0 -> bit 6 is 0; s=6 ends at 8 tokens
    prefill = StepRecord(0, "prefill", 1.0, 1, 5, total_ms=3.0, num_emitted=1)
    steps = [
        prefill,
        decode_step(1, [("a", 5, 3, 1)]),
        decode_step(2, [("a", 7, 2, 2)]),
        decode_step(3, [("a", 10, 1, 0)]),
        decode_step(4, [("a", 11, 0, 0)]),
    ]
    write_log(tmp_path / "a.sqlite", CONFIG, steps, [("a", 5, 8)])
    run = load_run(tmp_path / "a.sqlite")
    (req,) = run.requests
    assert (req.prompt_len, req.output_len, req.first_step) == (5, 8, 1)
    assert req.bits == [None, 1, 0, 1, 1, None, 0, None]
    # recorded at 0, 2, 5, 6; at 1, 3, 4 (skipped by accepted drafts) the cap of the step whose span it is
    assert req.recorded_k == {0: 3, 1: 3, 2: 2, 3: 2, 4: 2, 5: 1, 6: 0}
    assert (
        run.settings.max_num_seqs == 2
        and run.settings.scorers == ["mqa"]
        and run.settings.proposer == "draft"
    )
    bits = complete_bits(run, seed=3)
    assert bits.num_draftable == 6 and bits.num_imputed == 1  # index 5 (index 7 cannot be drafted)
    assert bits.bits[0][1:5] == [True, False, True, True] and bits.imputed[0][5] and not bits.imputed[0][4]
    assert complete_bits(run, seed=3).bits == bits.bits  # deterministic for a seed


def test_unknown_bits_come_from_other_lives_of_the_same_prompt(tmp_path):
    # a and b: one prompt (3 tokens, 8 out) sent twice; c: another prompt (4 tokens, 8 out)
    # a: s=0 k=2 a=2 -> bits 1, 2 = 1 (3 unknown: the bonus); s=3 k=1 a=0 -> bit 4 = 0; 5, 6 unknown
    # b: s=0 k=0; s=1 k=3 a=3 -> bits 2, 3, 4 = 1; s=5 k=1 a=0 -> bit 6 = 0; 1 and 5 unknown
    # c: s=0 k=2 a=0 -> bit 1 = 0; 2..6 unknown
    steps = [
        decode_step(0, [("a", 3, 2, 2), ("b", 3, 0, 0), ("c", 4, 2, 0)]),
        decode_step(1, [("a", 6, 1, 0), ("b", 4, 3, 3), ("c", 5, 0, 0)]),
        decode_step(2, [("a", 7, 0, 0), ("b", 8, 1, 0), ("c", 6, 0, 0)]),
    ]
    cfg = dict(CONFIG, scheduler={"max_num_seqs": 3})
    write_log(tmp_path / "p.sqlite", cfg, steps, [("a", 3, 8), ("b", 3, 8), ("c", 4, 8)])
    run = load_run(tmp_path / "p.sqlite")
    a, b, c = (run.requests[[r.key for r in run.requests].index(x)] for x in "abc")
    assert (a.bits[1:7], b.bits[1:7]) == ([1, 1, None, 0, None, None], [None, 1, 1, 1, None, 0])
    got = complete_bits(run, seed=5)
    row = {r.key: got.bits[i] for i, r in enumerate(run.requests)}
    assert row["a"][3] is True and row["a"][6] is False  # b's recorded bits
    assert row["b"][1] is True  # a's
    assert row["a"][4] is False and row["b"][4] is True  # a life's own bit wins over the others'
    # index 5 (neither recorded it) and c's unknown bits are drawn: as with pooling off
    alone = complete_bits(run, seed=5, pool_lives=False)
    drawn = {r.key: alone.bits[i] for i, r in enumerate(run.requests)}
    assert row["a"][5] == drawn["a"][5] and row["b"][5] == drawn["b"][5] and row["c"] == drawn["c"]
    assert got.num_pooled == 3 and alone.num_pooled == 0
    assert got.num_imputed == alone.num_imputed  # pooled bits are still not this request's own


def test_a_logged_prompt_hash_pools_lives_of_any_length_and_only_those(tmp_path):
    # a (8 out) and b (6 out: its max_tokens was lower) share prompt "h1"; c has a's lengths but "h2"
    # a: s=0 k=2 a=2 -> bits 1, 2; 3 unknown; s=3 k=1 a=0 -> bit 4 = 0
    # b: s=0 k=0; s=1 k=3 a=2 -> bits 2, 3 = 1, bit 4 = 0
    # c: s=0 k=1 a=0 -> bit 1 = 0; 2.. unknown
    steps = [
        decode_step(0, [("a", 3, 2, 2), ("b", 3, 0, 0), ("c", 3, 1, 0)]),
        decode_step(1, [("a", 6, 1, 0), ("b", 4, 3, 2), ("c", 4, 0, 0)]),
    ]
    cfg = dict(CONFIG, scheduler={"max_num_seqs": 3})
    finished = [("a", 3, 8, "h1"), ("b", 3, 6, "h1"), ("c", 3, 8, "h2")]
    write_log(tmp_path / "h.sqlite", cfg, steps, finished)
    run = load_run(tmp_path / "h.sqlite")
    assert sorted(r.prompt_hash for r in run.requests) == ["h1", "h1", "h2"]
    got, alone = complete_bits(run, seed=1), complete_bits(run, seed=1, pool_lives=False)
    row = {r.key: got.bits[i] for i, r in enumerate(run.requests)}
    drawn = {r.key: alone.bits[i] for i, r in enumerate(run.requests)}
    assert row["a"][3] is True and row["b"][1] is True  # b's bit 3 for a, a's bit 1 for b
    assert row["c"] == drawn["c"]  # the same lengths as a, another prompt: nothing pooled
    assert got.num_pooled == 2


BATCHING_LENGTHS = {"r0": 5, "r1": 3, "r2": 4, "r3": 2}  # output tokens; decode steps needed: L - 1


def write_batching_log(path) -> None:
    """Four requests, two at a time in join order, every draft rejected (k=1, a=0 at every index): one
    token per request per step. By hand: steps 1-2 r0+r1, r1 done; 3-4 r0+r2, r0 done; 5 r2+r3."""
    lengths = BATCHING_LENGTHS
    steps, step, live, pos = [], 0, ["r0", "r1"], {r: 0 for r in lengths}
    queue = ["r2", "r3"]
    while live:
        steps.append(decode_step(step, [(r, 10 + pos[r], 1, 0) for r in live]))
        step += 1
        for r in live:
            pos[r] += 1
        live = [r for r in live if pos[r] < lengths[r] - 1]
        while queue and len(live) < 2:
            live.append(queue.pop(0))
    write_log(path, CONFIG, steps, [(r, 10, n) for r, n in lengths.items()])


def test_batching_respects_max_num_seqs_and_join_order(tmp_path):
    lengths = BATCHING_LENGTHS
    write_batching_log(tmp_path / "b.sqlite")
    run = load_run(tmp_path / "b.sqlite")
    assert [r.key for r in run.requests] == ["r0", "r1", "r2", "r3"]
    report = replay(run, [{"name": "fixed", "k": 3, "scorer": "mqa"}])
    recorded, as_replayed, fixed3 = report.rows
    # by hand: steps 1-2 r0+r1, r1 done; 3-4 r0+r2, r0 done; 5 r2+r3, both done
    assert recorded.num_steps == as_replayed.num_steps == fixed3.num_steps == 5
    assert [t.batch_size for t in fixed3.trace] == [2, 2, 2, 2, 2]
    assert fixed3.num_decode_tokens == sum(n - 1 for n in lengths.values())
    assert fixed3.imputed_share == 0.0 and report.bits.imputed_share == 0.0  # every index was recorded
    # k is capped by the tokens left (L - 2 - s): r0 3,2,1,0; r1 1,0; r2 2,1,0; r3 0 -> 10 over 10
    assert fixed3.num_drafts == 10 and fixed3.mean_k == 1.0


def test_settings_from_either_config_layout_and_labels():
    app = {"proposer": {"name": "ngram", "max_k": 5}, "scheduler": {"max_num_seqs": 3},
           "scorer": {"names": ["mqa"]}, "policy": {"name": "goodput", "max_k": 4}}  # fmt: skip
    s = RunSettings.from_config(app, [])
    assert (s.proposer, s.max_k, s.max_num_seqs, s.scorers) == ("ngram", 5, 3, ["mqa"])
    assert s.defaulted == ["block_size"]
    engine_cfg = dataclasses.asdict(
        EngineConfig(spec=SpecConfig(proposer="draft", max_k=6), scheduler=SchedulerConfig(max_num_seqs=7))
    )
    s = RunSettings.from_config(engine_cfg, [])
    assert (s.proposer, s.max_k, s.max_num_seqs, s.policy) == ("draft", 6, 7, {"name": "fixed"})
    assert policy_label({"name": "fixed", "k": 3, "scorer": "mqa"}) == "fixed k=3"
    assert policy_label({"name": "goodput"}) == "goodput"


def test_ngram_ceiling_comes_from_the_recorded_k(tmp_path):
    cfg = dict(CONFIG, proposer={"name": "ngram", "max_k": 8}, scheduler={"max_num_seqs": 1})
    # s=0: no match (k=0); s=1: a match of 2 drafts, both accepted -> s=4: k=0 again
    steps = [
        decode_step(0, [("a", 3, 0, 0)]),
        decode_step(1, [("a", 4, 2, 2)]),
        decode_step(2, [("a", 7, 0, 0)]),
    ]
    write_log(tmp_path / "n.sqlite", cfg, steps, [("a", 3, 6)])
    run = load_run(tmp_path / "n.sqlite")
    report = replay(run, [{"name": "fixed", "k": 8, "scorer": "mqa"}])
    fixed8 = report.rows[-1]
    assert [round(t.mean_k) for t in fixed8.trace] == [0, 2, 0]  # never more than the recorded match


def test_ngram_ceiling_where_accepted_drafts_skipped_the_index_is_the_cap_at_the_span_start(tmp_path):
    cfg = dict(CONFIG, proposer={"name": "ngram", "max_k": 8}, scheduler={"max_num_seqs": 1})
    # the logged policy drafted the whole match of 4 at s=0 and all were accepted; the next step is s=5
    steps = [decode_step(0, [("a", 3, 4, 4)]), decode_step(1, [("a", 8, 0, 0)])]
    write_log(tmp_path / "m.sqlite", cfg, steps, [("a", 3, 7)])
    run = load_run(tmp_path / "m.sqlite")
    assert run.requests[0].recorded_k == {0: 4, 1: 4, 2: 4, 3: 4, 4: 4, 5: 0}
    report = replay(run, [{"name": "fixed", "k": 2, "scorer": "mqa"}])
    # fixed k=2: s=0 drafts 2 (both accepted) -> s=3, where the match still offers 4 but 2 tokens are
    # left before the last -> s=5 (or 4 if the imputed bit at 5 is 0): none there
    assert [round(t.mean_k) for t in report.rows[-1].trace][:2] == [2, 2]


def recorded_caps(path, max_k: int, steps: list[StepRecord], output_tokens: int) -> dict[int, int]:
    """The n-gram caps the replay reads for request "a" (prompt 3) of a log of ``steps``."""
    cfg = dict(CONFIG, proposer={"name": "ngram", "max_k": max_k}, scheduler={"max_num_seqs": 1})
    write_log(path, cfg, steps, [("a", 3, output_tokens)])
    return load_run(path).requests[0].recorded_k


def test_inside_an_accepted_span_the_cap_at_its_start_holds(tmp_path):
    """At s = 0 a match of 4 (uncapped with max_k 8, capped with max_k 4), all 4 drafts accepted; at
    s = 5 a match of 3, 1 of 2 drafts accepted; at s = 7 none. Every skipped index keeps the cap of the
    step whose accepted span it is in (the rule before 2026-12-07 took cap - j: 3, 2, 1, 0 at 1..4)."""
    steps = [
        decode_step(0, [("a", 3, 4, 4)]),
        decode_step(1, [("a", 8, 2, 1)]),
        decode_step(2, [("a", 10, 0, 0)]),
    ]
    steps[1].requests[0].max_k = 3  # the proposer offered 3, the policy drafted 2
    expected = {0: 4, 1: 4, 2: 4, 3: 4, 4: 4, 5: 3, 6: 3, 7: 0}
    assert recorded_caps(tmp_path / "u.sqlite", 8, steps, 10) == expected
    assert recorded_caps(tmp_path / "c.sqlite", 4, steps, 10) == expected


def test_the_ngram_proposer_keeps_its_offer_while_its_drafts_are_accepted():
    """What the rule above rests on: the continuation runs to the end of the context, so accepting its
    first j tokens shifts the occurrence by j and leaves the offer's length as it was."""
    tokens = [5, 6, 7, 8, 9, 1, 2, 3, 5, 6]  # "5 6" occurred at 0: continuation 7 8 9 1 2 3 5 6
    drafts = ngram_lookup(tokens, 1, 3, 16)
    assert drafts == [7, 8, 9, 1, 2, 3, 5, 6]
    for j in range(1, len(drafts)):
        assert len(ngram_lookup(tokens + drafts[:j], 1, 3, 16)) == len(drafts)  # not len(drafts) - j
    assert len(ngram_lookup(tokens + drafts[:3], 1, 3, 4)) == 4  # a capped offer stays capped


def test_policy_that_cannot_run_gets_an_error_row(tmp_path):
    write_log(tmp_path / "c.sqlite", CONFIG, [decode_step(0, [("a", 3, 1, 0)])], [("a", 3, 3)])
    report = replay(load_run(tmp_path / "c.sqlite"), [{"name": "threshold"}])
    assert report.rows[-1].error is not None and "batch_expansion" in report.rows[-1].error
    assert report.rows[1].error is None  # the recorded policy still replays


def test_bad_logs_raise_clear_errors(tmp_path):
    empty = tmp_path / "empty.sqlite"
    db = sqlite_utils.Database(empty)
    db.executescript(SCHEMA_SQL)
    db.execute("PRAGMA user_version = 1")
    db.close()
    with pytest.raises(ReplayError, match="holds no runs"):
        load_run(empty)
    write_log(tmp_path / "d.sqlite", CONFIG, [decode_step(0, [("a", 3, 1, 0)])], [("a", 3, 3)])
    with pytest.raises(ReplayError, match="no run 7; runs in this log: 1"):
        load_run(tmp_path / "d.sqlite", 7)
    run_of_steps = decode_step(1, [("a", 3, 0, 0)])  # scheduler.decode_steps: 3 forwards in one record
    run_of_steps.plan_info, run_of_steps.num_decode_steps = {"decode_steps": 3}, 3
    write_log(tmp_path / "m.sqlite", CONFIG, [decode_step(0, [("a", 2, 0, 0)]), run_of_steps], [("a", 2, 5)])
    # a run's record is one record; a config without the run options says so in ``defaulted``
    assert "runs" in load_run(tmp_path / "m.sqlite").settings.defaulted
    with_runs = {**CONFIG, "scheduler": {"max_num_seqs": 2, "decode_steps": 3}}
    steps = [decode_step(0, [("a", 2, 0, 0)]), run_of_steps]
    write_log(tmp_path / "m3.sqlite", with_runs, steps, [("a", 2, 5)])
    settings = load_run(tmp_path / "m3.sqlite").settings
    assert settings.runs == RunRules(decode_steps=3) and "runs" not in settings.defaulted
    after = decode_step(2, [("a", 5, 1, 1)])  # the step after the run: a draft model caught up
    after.plan_info, after.is_after_run = {"is_after_run": True}, True
    write_log(
        tmp_path / "r.sqlite", CONFIG, [decode_step(0, [("a", 2, 0, 0)]), run_of_steps, after], [("a", 2, 7)]
    )
    steps = load_run(tmp_path / "r.sqlite").steps
    assert [(s.num_decode_steps, s.is_after_run) for s in steps] == [(1, False), (3, False), (1, True)]
    db = sqlite_utils.Database(tmp_path / "d.sqlite")
    db.execute("update runs set schema_version = 0")
    db.conn.commit()
    db.close()
    with pytest.raises(LogFormatError, match="written with log schema version 0"):
        load_run(tmp_path / "d.sqlite")
    with pytest.raises(ValueError, match="forgetting"):
        ReplayOptions(forgetting=0.0)


# ---- fidelity against a live run ------------------------------------------------------------------

PROMPT_SEED, NUM_PROMPTS, MAX_TOKENS = 0, 8, 40
POLICY_A = {"name": "fixed", "k": 8, "scorer": "mqa"}


def make_engine(policy: dict) -> Engine:
    """Tiny target whose last two layers are damped (x0.1), so that its 2-layer self-draft agrees with
    it on about two thirds of the tokens: acceptance high enough for k to matter, and not 1."""
    cfg = EngineConfig(
        model=ModelConfig(source="tiny", device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=1024),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256),
        spec=SpecConfig(
            proposer="draft",
            scorers=["batch_expansion", "mqa"],
            max_k=8,
            draft=DraftConfig(source="self", num_layers=2),
        ),  # fmt: skip
        policy=policy,
    )
    engine = Engine(cfg)
    with torch.no_grad():
        for layer in engine.model.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return engine


def run_live(policy: dict, log_path=None) -> list[StepRecord]:
    """Run the prompts to completion (greedy); returns the step records, logged when ``log_path``."""
    rng = random.Random(PROMPT_SEED)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(4, 20))] for _ in range(NUM_PROMPTS)]
    engine = make_engine(policy)
    log = None
    if log_path is not None:
        log = LogWriter(LogConfig(path=str(log_path), flush_interval_s=0.05))
        log.start_run(dataclasses.asdict(engine.cfg), model="tiny", device="cpu", version="test")
    records: list[StepRecord] = []

    def on_step(rec: StepRecord) -> None:
        records.append(rec)
        if log is not None:
            log.write_step(rec)

    engine.on_step = on_step
    reqs = [
        Request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished:
        engine.step()
    if log is not None:
        for r in reqs:
            log.write_request(
                r.request_id, client=None, arrival=r.arrival_time, first_token_time=r.first_token_time,
                finish_time=time.time(), prompt_tokens=r.num_prompt_tokens, output_tokens=r.num_output_tokens,
                finish_reason=r.finish_reason, proposed=r.num_proposed, accepted=r.num_accepted,
            )  # fmt: skip
        log.close()
    return records


def tokens_per_step(records: list[StepRecord]) -> float:
    decode = [r for r in records if r.kind == "decode"]
    return sum(r.num_emitted for r in decode) / len(decode)


@pytest.fixture(scope="module")
def recorded_a(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model is quickest on one thread, and the CI box is shared
    path = tmp_path_factory.mktemp("replay") / "a.sqlite"
    yield path, run_live(POLICY_A, path)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("policy_b", [{"name": "fixed", "k": 3, "scorer": "mqa"}, {"name": "hf_heuristic"}])
def test_replay_predicts_tokens_per_step_of_a_live_run(recorded_a, policy_b):
    path, records_a = recorded_a
    report = replay(load_run(path), [policy_b])
    recorded, as_replayed, predicted = report.rows
    # the recorded policy's own replay reads only recorded bits and reproduces the log exactly
    assert as_replayed.imputed_share == 0.0
    assert (as_replayed.num_steps, as_replayed.mean_k) == (recorded.num_steps, pytest.approx(recorded.mean_k))
    assert recorded.tokens_per_step == pytest.approx(tokens_per_step(records_a))
    measured_b = tokens_per_step(run_live(policy_b))
    print(
        f"\n{policy_label(policy_b)}: replay {predicted.tokens_per_step:.3f} tokens/step, "
        f"live {measured_b:.3f}; "
        f"A (k=8) {tokens_per_step(records_a):.3f}; imputed {100 * predicted.imputed_share:.1f}% of the bits "
        f"read, {100 * report.bits.imputed_share:.1f}% of the run's positions"
    )
    # the test means something: B's tokens/step is far from A's, and the replay tracks B's
    assert abs(measured_b / tokens_per_step(records_a) - 1) > 0.1
    assert predicted.tokens_per_step == pytest.approx(measured_b, rel=0.05)
    assert predicted.imputed_share < 0.15 and report.bits.imputed_share < 0.15


def test_refit_cost_model_and_goodput_replay(recorded_a):
    path, _ = recorded_a
    run = load_run(path)
    costs = refit_costs(run)
    # every decode step refitted, or skipped by a guard (a loaded machine's slow launches, in the log)
    assert costs.model("score", "mqa").num_updates + costs.num_skipped == len(run.decode_steps)
    bits = complete_bits(run)
    result = simulate(run, bits, build_policy({"name": "goodput"}), costs, "goodput")
    assert result.num_decode_tokens == sum(r.output_len - 1 for r in run.requests)
    assert result.num_steps >= max(r.output_len - 1 for r in run.requests) / 9  # at most k+1 = 9 per step
    assert result.predicted_ms > 0 and all(t.batch_size <= 2 for t in result.trace)
