"""``bench=regret`` on CPU (issue 13): the tiny preset's two cells run every config in interleaved
repeats, and the table's ratios are the ones its rows imply."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import specsched.bench.cli as cli
from specsched.bench.regret import NON_SPEC, summarize
from specsched.engine.config import SchedulerConfig

CONF_DIR = str(Path(cli.__file__).parent / "conf")
CONFIGS = [NON_SPEC, "fixed k=2 batch_expansion", "fixed k=2 mqa", "policy goodput"]
# the real cell also runs a goodput variant whose engine alone has another decide budget
VARIANT = "policy goodput (scheduler.decide_budget=0.5)"


def configs_of(cell: dict) -> list[str]:
    return CONFIGS + [VARIANT] if cell["suite"] == "real" else CONFIGS


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("regret")
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        overrides = [
            "bench=regret_cpu",
            f"bench.out_dir={out}",
            f"bench.regret.log_dir={out / 'logs'}",
            "bench.regret.scheduler={decide_cost: host}",  # every window's engine
            "bench.regret.min_steps_by_batch={2: 14}",  # the batch-2 cell's windows run longer
            "bench.regret.real.policies=[goodput,goodput@budget]",
        ]
        cfg = compose("bench", overrides=overrides).bench
    cfg.regret.real.policy_args = {"goodput@budget": {"scheduler": {"decide_budget": 0.5}}}
    written: list[int] = []  # cells in results.json at each write
    with pytest.MonkeyPatch.context() as mp:
        inner = cli.write_outputs

        def spy(results, cfg, final):
            text = inner(results, cfg, final)
            on_disk = json.loads((out / "results.json").read_text())
            written.append(len((on_disk.get("regret") or {}).get("cells", [])))
            return text

        mp.setattr(cli, "write_outputs", spy)
        res = cli.run_bench(cfg, "specsched-bench bench=regret_cpu")
    return res, cfg.regret, (out / "tables.md").read_text(), written


def test_every_config_of_every_cell_runs_interleaved_repeats(result):
    res, cfg, _, _ = result
    assert res["errors"] == {}
    cells = res["regret"]["cells"]
    assert [(c["suite"], c["proposer"], c["batch"]) for c in cells] == [
        ("synthetic", "synthetic a=0.8", 2), ("real", "ngram", 1)
    ]  # fmt: skip
    for c in cells:
        samples = c["samples"]
        configs = configs_of(c)
        assert list(c["configs"]) == configs
        assert [s["repeat"] for s in samples] == [r for r in range(cfg.repeats) for _ in configs]
        for r in range(cfg.repeats):  # each repeat runs every config once
            assert sorted(s["config"] for s in samples if s["repeat"] == r) == sorted(configs)
        assert all(s["num_steps"] >= cfg.min_steps and s["tokens_per_s"] > 0 for s in samples)
        assert all(s["num_compiles"] == 0 for s in samples)  # CPU: torch kernels, nothing compiled
        assert all(v["num_compiles"] == 0 and v["num_full_gc"] >= 0 for v in c["configs"].values())
        if c["batch"] == 2:  # min_steps_by_batch: ~5 steps a pass, so 6 would stop after 2 passes
            assert min(s["num_steps"] for s in samples) >= 14
        good = [s for s in samples if s["config"] == "policy goodput"]
        assert all(s["decide_ms_p99"] >= s["decide_ms_p50"] > 0 for s in good)
        assert {e["scorer"] for e in c["cost_error"]} <= {"batch_expansion", "mqa"} and c["cost_error"]
        assert all(e["median"] >= 0 and e["num_held_out"] > 0 for e in c["cost_error"])
        assert all(e["live_median"] is not None and e["live_median"] >= 0 for e in c["cost_error"])


def test_ratios_follow_from_the_rows(result):
    res, cfg, text, _ = result
    for c in res["regret"]["cells"]:
        configs = configs_of(c)
        tps = {label: [s["tokens_per_s"] for s in c["samples"] if s["config"] == label] for label in configs}
        for label, v in c["configs"].items():
            assert v["tokens_per_s"] == pytest.approx(statistics.median(tps[label]))
            assert v["min"] == min(tps[label]) and v["max"] == max(tps[label])
        others = [label for label in CONFIGS if label != "policy goodput"]  # a variant is no oracle
        assert c["oracle"] == max(others, key=lambda x: statistics.median(tps[x]))
        for key, other in (("vs_oracle", c["oracle"]), ("vs_non_spec", NON_SPEC)):
            per = [g / o for g, o in zip(tps["policy goodput"], tps[other], strict=True)]
            assert c[key]["per_repeat"] == pytest.approx(per)
            assert c[key]["median"] == pytest.approx(statistics.median(per))
            assert (c[key]["min"], c[key]["max"]) == (pytest.approx(min(per)), pytest.approx(max(per)))
            assert f"{c[key]['median']:.3f} [{c[key]['min']:.3f}–{c[key]['max']:.3f}]" in text
    assert "repeats of >= 6 decode steps per config (at batch 2: >= 14), closed groups (" in text
    assert "| predicted before learnt (live) median % |" in text
    assert (
        "| min steps | compiles in windows | full GCs in windows | step / propose / score ms "
        "| propose host / fresh / carried ms | young GCs" in text
    )
    for c in res["regret"]["cells"]:  # each config's phases: the median over its repeats' windows
        for label, v in c["configs"].items():
            mine = [s["step_ms"] for s in c["samples"] if s["config"] == label]
            for k in ("step", "propose", "score", "propose_host"):
                assert v["step_ms"][k] == statistics.median(m[k] for m in mine)
            assert v["step_ms"]["step"] > v["step_ms"]["score"] > 0 and v["young_gc_per_step"] >= 0
    for title in ("### Regret (issue 13)", "### Regret: every config", "### Cost-model held-out error"):
        assert title in text


def test_summary_without_goodput_names_the_oracle_only():
    from specsched.bench.regret_windows import Sample

    samples = [Sample(label, r, tps, 10, 1, 0.0, None, None) for r in range(2)
               for label, tps in ((NON_SPEC, 100.0 + r), ("fixed k=1 mqa", 120.0 - r))]  # fmt: skip
    out = summarize(samples, [NON_SPEC, "fixed k=1 mqa"])
    assert out["oracle"] == "fixed k=1 mqa" and out["goodput"] is None


def test_a_goodput_variant_is_a_config_of_its_own_and_an_a_b_against_goodput():
    from omegaconf import OmegaConf

    from specsched.bench.e2e import policy_configs
    from specsched.bench.regret import regret_markdown
    from specsched.bench.regret_windows import Sample

    cfg = OmegaConf.create({"fixed_k": [], "fixed_scorers": [], "policies": ["goodput", "goodput@no_tries"],
                            "policy_args": {"goodput@no_tries": {"try_interval": 0}}})  # fmt: skip
    built = {e.label: e.make() for e in policy_configs(cfg, ["mqa"])}
    assert list(built) == ["policy goodput", "policy goodput (try_interval=0)"]
    assert [p.config.try_interval for p in built.values()] == [16, 0]

    labels = [NON_SPEC, "fixed k=1 mqa", *built]
    rates = {
        NON_SPEC: 100.0,
        "fixed k=1 mqa": 120.0,
        "policy goodput": 130.0,
        "policy goodput (try_interval=0)": 110.0,
    }
    samples = [
        Sample(label, r, tps + r, 10, 1, 0.0, None, None) for r in range(3) for label, tps in rates.items()
    ]
    out = summarize(samples, labels)
    assert out["goodput"] == "policy goodput" and out["oracle"] == "fixed k=1 mqa"  # a variant is no oracle
    per = [(130.0 + r) / (110.0 + r) for r in range(3)]
    assert out["vs_variants"]["policy goodput (try_interval=0)"]["per_repeat"] == pytest.approx(per)
    cell = {
        "suite": "synthetic",
        "model": "m",
        "proposer": "synthetic a=0.3",
        "batch": 4,
        "cost_error": [],
        **out,
    }
    text = regret_markdown({"cells": [cell], "repeats": 3, "min_steps": 10})
    r = out["vs_variants"]["policy goodput (try_interval=0)"]
    line = f"- synthetic a=0.3, batch 4: policy goodput / policy goodput (try_interval=0) {r['median']:.3f}"
    assert line in text


def test_each_timed_window_is_one_run_of_its_cell_s_decision_log(result):
    """bench.regret.log_dir: one log per cell, one run per (config, repeat), every step of the window
    (its decode steps as many as the sample counted) and the cost models it started from."""
    from specsched.bench.plan_gap import read_log
    from specsched.engine.log_schema import open_log

    res, cfg, _, _ = result
    logs = Path(cfg.log_dir)
    assert sorted(p.name for p in logs.glob("*.sqlite")) == [
        "real_ngram_b1.sqlite",
        "synthetic_a_0.8_b2.sqlite",
    ]
    for c in res["regret"]["cells"]:
        name = "real_ngram_b1" if c["suite"] == "real" else "synthetic_a_0.8_b2"
        db = open_log(str(logs / f"{name}.sqlite"))
        runs = {r["id"]: json.loads(r["config"]) for r in db.query("select id, config from runs")}
        assert sorted((r["config"], r["repeat"]) for r in runs.values()) == sorted(
            (s["config"], s["repeat"]) for s in c["samples"]
        )
        assert all(r["bench"] == "regret" and r["batch"] == c["batch"] for r in runs.values())
        for r in runs.values():  # the engine's whole scheduler: the cell's options, a variant's own on top
            own = {"decide_budget": 0.5} if r["config"] == VARIANT else {}
            options = dict(max_num_seqs=c["batch"], max_num_batched_tokens=4096, decide_cost="host", **own)
            assert r["scheduler"] == dataclasses.asdict(SchedulerConfig(**options))
        for run_id, run in runs.items():
            sample = next(
                s for s in c["samples"] if (s["config"], s["repeat"]) == (run["config"], run["repeat"])
            )
            infos = db.execute(
                "select plan_info from steps where run_id = ? and kind = 'decode'", [run_id]
            ).fetchall()
            # a run of S plain steps (non-speculative alone: scheduler.plain_decode_steps) counts S
            n = sum(json.loads(i).get("decode_steps", 1) if i else 1 for (i,) in infos)
            assert n == sample["num_steps"]
            assert db.execute("select count(*) from cost_models where run_id = ?", [run_id]).fetchone()[0] > 0
    last = read_log(str(logs / "real_ngram_b1.sqlite"), [1])[1]  # the last run: a window at batch 1
    assert last.num_steps > 0
    # the replay reads each window's engine from its config: nothing left to defaults
    from specsched.policies.replay_log import load_run

    db = open_log(str(logs / "real_ngram_b1.sqlite"))
    for run_id, config in (
        (r["id"], json.loads(r["config"])) for r in db.query("select id, config from runs")
    ):
        # the non-speculative window at batch 1 ran plain steps in runs: its run options are read too
        settings = load_run(str(logs / "real_ngram_b1.sqlite"), run_id).settings
        assert settings.defaulted == [], (config["config"], settings.defaulted)
        assert settings.scorers == list(cfg.real.scorers) and settings.max_k == cfg.real.max_k
        assert settings.proposer == ("none" if config["config"] == NON_SPEC else "ngram")
        assert settings.policy["name"] in ("fixed", "goodput")


def test_a_window_counts_forwards_so_runs_of_plain_steps_do_not_lengthen_it():
    from types import SimpleNamespace

    from specsched.bench.regret_windows import closed_window
    from tests.engine.test_multi_step import engine

    e = engine("mqa", 4, graphs=False)  # non-speculative in runs of 4 plain steps
    cell = SimpleNamespace(prompts=[[5, 6, 7], [8, 9, 10, 11]], batch=2, max_new_tokens=16,
                           spec=SimpleNamespace(model=e.model))  # fmt: skip
    fields, records, _ = closed_window(e, cell, 40)
    forwards = sum(r.num_decode_steps for r in records)
    assert fields["num_steps"] == forwards >= 40
    assert len(records) < forwards  # runs ran: counted as records the window would take ~4x as long
    assert forwards < 40 + 2 * 15  # whole passes (15 decode forwards each): it stops at the first over 40


def test_results_are_written_after_each_cell(result):
    """A device call cut at its time limit keeps the cells it finished: results.json holds the first
    cell before the second one runs."""
    res, _, _, written = result
    assert len(res["regret"]["cells"]) == 2
    assert written[:2] == [1, 2] and written[-1] == 2, written


def test_a_window_counts_the_compiles_and_full_collections_inside_it(monkeypatch):
    """A Triton variant built (the compile watch's hook fires) or a full collection inside a timed
    window is counted in its sample; nothing outside the window is (the warm-up's builds are not)."""
    import gc
    from types import SimpleNamespace

    from specsched.bench.regret_windows import closed_window
    from specsched.kernels.compile_watch import compile_watch
    from tests.engine.test_multi_step import engine

    watch = compile_watch()
    e = engine("mqa", 1, graphs=False, proposer="ngram", ks=(2, 0))
    cell = SimpleNamespace(prompts=[[5, 6, 7, 5, 6], [8, 9, 10, 11]], batch=2, max_new_tokens=6,
                           spec=SimpleNamespace(model=e.model))  # fmt: skip
    fields, records, _ = closed_window(e, cell, 1)
    assert fields["num_compiles"] == 0  # CPU: torch kernels, nothing built
    ms = fields["step_ms"]  # medians of the decode records' fields
    assert ms["step"] == statistics.median(r.total_ms for r in records) >= ms["propose"] >= 0
    assert ms["score"] == statistics.median(r.score_ms for r in records) > 0
    assert fields["young_gc_per_step"] >= 0
    # on the host path a phase's time is its host time: the two medians agree
    assert ms["propose_host"] == pytest.approx(statistics.median(r.host_ms["propose"] for r in records))
    assert ms["propose_host"] == pytest.approx(ms["propose"], abs=1e-6)

    watch._hook(repr="_warm_up_kernel[...]")  # a build before the window: not its stall
    e2 = engine("mqa", 1, graphs=False, proposer="ngram", ks=(2, 0))
    inner, num_steps = e2.step, [0]

    def step():  # a variant built and a full collection after the window's second step
        out = inner()
        num_steps[0] += 1
        if num_steps[0] == 2:
            watch._hook(repr="_paged_attn_kernel[BLOCK_Q=8]")
            gc.collect()
            for generation in (0, 0, 0, 1, 1):  # young passes, as allocations trigger them
                gc.collect(generation)
        return out

    monkeypatch.setattr(e2, "step", step)
    fields, records, _ = closed_window(e2, cell, 1)
    assert fields["num_compiles"] == 1 and fields["num_full_gc"] >= 1
    assert fields["young_gc_per_step"] >= 5 / len(records)


def test_a_refilled_window_keeps_its_batch_full_where_closed_groups_drain():
    """``bench.regret.refill``: a finished request's slot goes to the next prompt at once, so every
    decode step of the window runs the whole batch; closed groups of equal-length requests, with
    speculation spreading their progress, end in steps of a draining batch. The requests still
    running at the window's end finish outside it and leave no record."""
    from types import SimpleNamespace

    from specsched.bench.regret_windows import closed_window, refilled_window
    from tests.engine.test_multi_step import engine

    prompts = [[5, 6, 7, 5, 6, 7, 5], [8, 9, 10, 11], [12, 13, 12, 13, 12], [20, 21], [30, 31, 30, 31]]

    def run(window):
        e = engine("mqa", 1, graphs=False, proposer="ngram", ks=(3, 0, 1, 2))
        cell = SimpleNamespace(
            prompts=prompts, batch=3, max_new_tokens=9, spec=SimpleNamespace(model=e.model)
        )
        fields, records, steps = window(e, cell, 40)
        assert not e.has_unfinished and e.on_step is None
        return fields, records, steps

    fields, records, steps = run(refilled_window)
    assert [r.batch_size for r in records] == [3] * len(records) and len(records) == fields["num_steps"] >= 40
    assert fields["num_passes"] > 1 and fields["tokens_per_s"] > 0
    assert sum(r.num_emitted for r in records) >= fields["num_steps"] * 3  # >= 1 token a request a step
    assert any(r.kind == "prefill" and 0 < steps.index(r) for r in steps)  # refills mid-window

    _, closed, _ = run(closed_window)
    assert min(r.batch_size for r in closed) < 3  # the groups drain


def test_a_staggered_window_refills_a_plain_engine_at_a_steady_rate():
    """``bench.regret.stagger``: the first requests stop after 3, 6 and 9 tokens (of 9), so a plain
    engine (one token a request a step) finishes and refills them one at a time; unstaggered, its
    equal-length requests stay in step and refill together, in one prefill step."""
    from types import SimpleNamespace

    from specsched.bench.regret_windows import refilled_window
    from tests.engine.test_multi_step import engine

    prompts = [[5, 6, 7, 5, 6, 7, 5], [8, 9, 10, 11], [12, 13, 12, 13, 12], [20, 21], [30, 31, 30, 31]]

    def refills(stagger: bool) -> tuple[list[int], list[int]]:
        e = engine("mqa", 1, graphs=False)
        spec = SimpleNamespace(model=e.model)
        cell = SimpleNamespace(prompts=prompts, batch=3, max_new_tokens=9, spec=spec)
        _, records, steps = refilled_window(e, cell, 24, stagger)
        firsts = [q.request_id for r in records for q in r.requests]
        prefills = [i for i, r in enumerate(steps) if r.kind == "prefill" and i > 0]
        return prefills, [firsts.count(f"w-{i}") for i in range(3)]

    prefills, steps_of_firsts = refills(stagger=True)
    assert steps_of_firsts == [2, 5, 8]  # 3, 6, 9 tokens: the prefill's and then one a decode step
    assert len(prefills) >= 3 and len(set(prefills)) == len(prefills)  # one refill at a time
    prefills, steps_of_firsts = refills(stagger=False)
    assert steps_of_firsts == [8, 8, 8]
    assert len(prefills) <= 2  # all three refilled together (a chunk of 64 tokens holds them)


def test_the_grid_past_batch_1_runs_refilled_windows():
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        grid = compose("bench", overrides=["bench=regret_h200_grid"]).bench.regret
        assert grid.refill is True and grid.stagger is True
        assert compose("bench", overrides=["bench=regret"]).bench.regret.refill is False


def test_the_tables_say_which_window_shape_ran():
    from specsched.bench.regret import regret_markdown

    res = {"cells": [], "repeats": 3, "min_steps": 500, "errors": {}, "min_steps_by_batch": {}}
    assert "closed groups (" in regret_markdown(res)
    assert "refilled windows (" in regret_markdown({**res, "refill": True})
    assert "first requests cut short" in regret_markdown({**res, "refill": True, "stagger": True})
    assert "first requests cut short" not in regret_markdown({**res, "refill": True})
    assert "held each (k, scorer) 4 steps" in regret_markdown({**res, "profile_hold": 4})
    assert "held each" not in regret_markdown(res)


def test_the_warm_up_profile_holds_each_pair_for_profile_hold_steps():
    from specsched.bench.regret import ProfilePolicy
    from specsched.policies.base import BatchView, RequestView

    view = BatchView([RequestView("r", 10, "synthetic", 8, 0.5, 0.1)], 100, 16, ["be", "mqa"])

    def picks(hold: int) -> list[tuple[int, str]]:
        policy = ProfilePolicy([0, 3], ["be", "mqa"], hold)
        return [(p.k[0], p.scorer) for p in (policy.decide(view, None) for _ in range(8))]

    assert picks(1) == [(0, "be"), (0, "mqa"), (3, "be"), (3, "mqa")] * 2
    assert picks(3) == [(0, "be")] * 3 + [(0, "mqa")] * 3 + [(3, "be")] * 2
    with pytest.raises(ValueError, match="profile_hold"):
        ProfilePolicy([0], ["be"], 0)


def test_a_variant_s_scheduler_options_are_its_engine_s_and_a_typo_is_named():
    from omegaconf import OmegaConf

    from specsched.bench.common import make_engine
    from specsched.bench.e2e import policy_configs
    from specsched.bench.regret_cells import synthetic_cells

    args = {"goodput@late": {"try_interval": 0, "scheduler": {"carry_late_due": True, "decide_budget": 0.1}}}
    cfg = OmegaConf.create({"fixed_k": [2], "fixed_scorers": ["mqa"], "policies": ["goodput", "goodput@late"],
                            "policy_args": args})  # fmt: skip
    entries = policy_configs(cfg, ["mqa"])
    assert [(e.label, e.scheduler) for e in entries] == [
        ("fixed k=2 mqa", {}),
        ("policy goodput", {}),
        ("policy goodput (try_interval=0, scheduler.carry_late_due=True, scheduler.decide_budget=0.1)",
         {"carry_late_due": True, "decide_budget": 0.1}),
    ]  # fmt: skip
    assert entries[2].make().config.try_interval == 0  # the policy options still reach the policy
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        bench = compose("bench", overrides=["bench=regret_cpu"]).bench
    cell = next(
        synthetic_cells(bench.regret.synthetic, bench.graphs, torch.device("cpu"), torch.float32, 4, 0)
    )
    spec = cell.spec
    spec.scheduler = {"decide_budget": 0.3, "max_plan_age": 5}
    run = cell.runs[-1]
    late = make_engine(spec, run.proposers, run.proposer, entries[2].make(), entries[2].scheduler)
    plain = make_engine(spec, run.proposers, run.proposer, entries[1].make(), entries[1].scheduler)
    assert (late.cfg.scheduler.carry_late_due, late.cfg.scheduler.decide_budget) == (True, 0.1)
    assert (plain.cfg.scheduler.carry_late_due, plain.cfg.scheduler.decide_budget) == (False, 0.3)
    assert late.cfg.scheduler.max_plan_age == plain.cfg.scheduler.max_plan_age == 5  # the cell's own stay
    bad = OmegaConf.create({"fixed_k": [], "fixed_scorers": [], "policies": ["goodput@x"],
                            "policy_args": {"goodput@x": {"scheduler": {"plan_ahaed": "off"}}}})  # fmt: skip
    with pytest.raises(ValueError, match=r"policy_args.goodput@x.scheduler: unknown scheduler option\(s\) "
                       r"plan_ahaed; known: .*plan_ahead"):  # fmt: skip
        policy_configs(bad, ["mqa"])
    bad.policy_args["goodput@x"] = {"scheduler": {"plan_ahead": False}}  # YAML's bare off
    with pytest.raises(
        ValueError, match="policy_args.goodput@x.scheduler: scheduler.plan_ahead must be auto, on or off"
    ):
        policy_configs(bad, ["mqa"])


def test_step_phases_split_propose_by_where_the_plan_came_from():
    """``propose_fresh``: steps that ran a plan decided ahead for them (plan_age 0); ``propose_carried``:
    steps that ran a held plan again; a step that decided on its own critical path is neither."""
    from specsched.bench.regret_windows import step_phases
    from specsched.engine.records import StepRecord

    def rec(propose_ms: float, host: float, **info) -> StepRecord:
        r = StepRecord(
            0, "decode", 0.0, 4, 36, propose_ms=propose_ms, score_ms=5.0, total_ms=9.0, plan_info=info
        )
        r.host_ms = {"propose": host}
        return r

    records = [
        rec(2.0, 1.5, is_planned_ahead=True, plan_age=0),
        rec(2.4, 1.9, is_planned_ahead=True, plan_age=0),
        rec(1.0, 0.9, is_planned_ahead=True, plan_age=1),
        rec(1.2, 0.8, plan_age=2),
        rec(7.0, 0.7, decide_ms=0.4),  # decided on the step: in neither split
    ]
    ms = step_phases(records)
    assert ms["propose"] == 2.0 and ms["propose_host"] == 0.9
    assert ms["propose_fresh"] == pytest.approx(2.2) and ms["propose_carried"] == pytest.approx(1.1)
    alone = step_phases([rec(3.0, 1.0, decide_ms=0.2)])
    assert alone["propose_fresh"] is None and alone["propose_carried"] is None


def test_the_repeats_median_skips_a_phase_a_repeat_lacks():
    from specsched.bench.regret import _median_dict

    got = _median_dict([{"a": 1.0, "b": None}, None, {"a": 3.0, "b": 4.0}, {"a": 2.0, "b": 6.0}])
    assert got == {"a": 2.0, "b": 5.0}
    assert _median_dict([{"a": None}]) == {"a": None} and _median_dict([None]) is None


def test_a_config_may_ask_for_the_draft_loop_graphs_and_only_it_uses_them():
    """``policy_args``' ``draft_loop: true``: that config's label and RunConfig say so, the cell
    captures the graphs when any config asks, and before each window the shared draft (a synthetic
    proposer's paid draft too) is switched to the loop for that config alone."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from specsched.bench.e2e import RunConfig, policy_configs, use_draft_loop, wants_draft_loop

    args = {"fixed@loop": {"k": 2, "scorer": "mqa", "draft_loop": True}}
    cfg = OmegaConf.create({"fixed_k": [2], "fixed_scorers": ["mqa"], "policies": ["fixed@loop"],
                            "policy_args": args})  # fmt: skip
    entries = policy_configs(cfg, ["mqa"])
    assert [(e.label, e.draft_loop) for e in entries] == [
        ("fixed k=2 mqa", False),
        ("policy fixed (k=2, scorer=mqa, draft.loop_graphs=true)", True),
    ]
    assert entries[1].make().config.k == 2  # draft_loop is no policy option
    assert wants_draft_loop(cfg, ["mqa"]) and not wants_draft_loop(
        OmegaConf.create({"fixed_k": [2], "fixed_scorers": ["mqa"], "policies": []}), ["mqa"]
    )
    draft = SimpleNamespace(is_loop_used=True)
    synthetic = SimpleNamespace(draft=draft)
    for entry, want in ((entries[0], False), (entries[1], True), (entries[0], False)):
        use_draft_loop(
            RunConfig(entry.label, entry.make, {"synthetic": synthetic}, "synthetic", {}, entry.draft_loop)
        )
        assert draft.is_loop_used is want
    bad = OmegaConf.create({"fixed_k": [], "fixed_scorers": [], "policies": ["goodput@x"],
                            "policy_args": {"goodput@x": {"draft_loop": "yes"}}})  # fmt: skip
    with pytest.raises(ValueError, match="policy_args.goodput@x.draft_loop must be true or false, got 'yes'"):
        policy_configs(bad, ["mqa"])


def test_a_cell_with_a_loop_config_captures_the_loop_graphs_and_only_that_config_replays_them():
    """bench=regret_cpu on emulated graphs with a config asking ``draft_loop: true``: the cell's draft
    gets the loop graphs, and only that config's window replays them (the others go step by step)."""
    from omegaconf import OmegaConf

    from specsched.bench.regret import profile_state
    from specsched.bench.regret_cells import synthetic_cells
    from specsched.bench.regret_windows import run_window

    loop_args = "{fixed@loop: {k: 2, scorer: mqa, draft_loop: true}}"
    overrides = ["bench=regret_cpu", "bench.graphs.enabled=true", "bench.graphs.emulate=true",
                 "bench.graphs.progress=false", "bench.regret.synthetic.policies=[goodput,fixed@loop]",
                 f"+bench.regret.synthetic.policy_args={loop_args}"]  # fmt: skip
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        bench = compose("bench", overrides=overrides).bench
    plain = OmegaConf.to_container(bench.regret, resolve=True)  # the suite's section, as run_regret
    common = {k: v for k, v in plain.items() if k not in ("synthetic", "real")}  # merges it
    cfg = OmegaConf.merge(OmegaConf.create(common), OmegaConf.create(plain["synthetic"]))
    cell = next(synthetic_cells(cfg, bench.graphs, torch.device("cpu"), torch.float32, 4, 0))
    draft = cell.runs[-1].proposers["synthetic"].draft
    loop = draft.loop_graphs
    assert loop is not None and loop.num_graphs > 0
    state = profile_state(cell, cfg)
    assert loop.num_replays == 0  # the shared warm-up profiles the step-by-step path
    for run in cell.runs:
        before = loop.num_replays
        run_window(run, state, cell, 6)
        assert (loop.num_replays > before) is run.draft_loop, run.label
    assert [r.label for r in cell.runs if r.draft_loop] == [
        "policy fixed (k=2, scorer=mqa, draft.loop_graphs=true)"
    ]
