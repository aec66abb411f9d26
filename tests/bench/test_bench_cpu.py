"""specsched-bench on CPU: the hydra app end-to-end with the tiny preset (``bench=smoke``), failure
isolation between parts, the markdown report and the transformers peer runner."""

from __future__ import annotations

import json
import math
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import specsched.bench.cli as cli
from specsched.bench.common import copy_bandwidth, random_model, streamed_weight_bytes
from specsched.bench.peers import run_peers
from specsched.bench.report import e2e_table, render, scorer_table, targets_table
from specsched.bench.scorers import shared_prefix_batch

CONF_DIR = str(Path(cli.__file__).parent / "conf")


def smoke_cfg(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("bench", overrides=["bench=smoke", *overrides]).bench


@pytest.mark.slow
def test_cli_smoke_run_end_to_end(tmp_path):
    md = tmp_path / "docs" / "benchmarks.md"
    cmd = [sys.executable, "-m", "specsched.bench.cli", "bench=smoke", f"hydra.run.dir={tmp_path}",
           "hydra.output_subdir=null", f"bench.out_dir={tmp_path}", f"bench.append_to={md}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["errors"] == {}
    scorer_rows = res["scorers"]["rows"]
    want = {(b, 2, 12, s) for b in (1, 2) for s in ("batch_expansion", "mqa", "mqa_graph", "mqa piecewise")}
    assert {(r["batch"], r["k"], r["context"], r["scorer"]) for r in scorer_rows} == want
    assert all(r["ms"] > 0 and not r["error"] for r in scorer_rows)
    paths = {r["scorer"]: r["path"] for r in scorer_rows}
    assert paths["mqa_graph"] == "graph"  # emulated replay, no fallback
    assert paths["mqa piecewise"] == "piecewise" and paths["mqa"] == "eager"
    e2e = res["e2e"]
    assert [r["config"] for r in e2e] == [
        "non-speculative", "fixed k=2 batch_expansion", "fixed k=2 mqa_graph", "policy goodput"
    ]  # fmt: skip
    assert all(not r["error"] and r["num_tokens"] == 3 * 5 and r["tokens_per_s"] > 0 for r in e2e)
    assert all(r["graph_fallbacks"] == 0 for r in e2e)
    assert e2e[1]["scorer_steps"].keys() == {"batch_expansion"} and e2e[1]["mean_k"] > 0
    # float32 on CPU: every speculative row reproduces the non-speculative outputs
    assert [r["same_output"] for r in e2e[1:]] == [1.0, 1.0, 1.0] and e2e[0]["same_output"] is None
    assert all(r["step_ms"]["total"] >= r["step_ms"]["score"] > 0 for r in e2e)
    real = res["real"]
    assert {r["proposer"] for r in real} == {"none", "draft (self, 2 layers)", "ngram"}
    assert all(not r["error"] and r["num_tokens"] == 5 for r in real)
    assert all(r["same_output"] == 1.0 for r in real if r["proposer"] != "none")
    text = (tmp_path / "tables.md").read_text()
    for title in ("Scorer micro-benchmark", "End-to-end", "Targets (issue 5)"):
        assert f"### {title}" in text
    assert "Command: `specsched-bench bench=smoke" in text and text in proc.stdout
    assert md.read_text().startswith("# Benchmarks") and text in md.read_text()


def test_a_failing_part_does_not_stop_the_others(tmp_path):
    cfg = smoke_cfg(
        "bench.scorers.model=no-such-preset",
        "bench.e2e.enabled=false",
        f"bench.out_dir={tmp_path}",
        "bench.real.proposers=[ngram]",
    )
    res = cli.run_bench(cfg, "specsched-bench test")
    assert "unknown model preset 'no-such-preset'" in res["errors"]["scorers"]
    assert [r["config"] for r in res["real"]] == ["non-speculative", "fixed k=2 mqa_graph"]
    text = (tmp_path / "tables.md").read_text()
    assert "**scorers failed**" in text and "### End-to-end" in text


def test_e2e_runs_go_to_a_decision_log(tmp_path):
    """``bench.e2e.log_path``: one run per table row in a real SQLite log, every step of it."""
    db = tmp_path / "bench.sqlite"
    cfg = smoke_cfg(
        "bench.scorers.enabled=false", "bench.real.enabled=false", f"bench.out_dir={tmp_path}",
        f"bench.e2e.log_path={db}",
    )  # fmt: skip
    res = cli.run_bench(cfg, "specsched-bench test")
    assert res["errors"] == {}
    con = sqlite3.connect(db)
    runs = {json.loads(c)["config"]: i for i, c in con.execute("select id, config from runs").fetchall()}
    assert sorted(runs) == sorted(r["config"] for r in res["e2e"])
    goodput = runs["policy goodput"]
    kinds = dict(con.execute("select kind, count(*) from steps where run_id = ? group by kind", [goodput]))
    assert kinds["decode"] > 0 and kinds["prefill"] > 0
    num_req = con.execute("select count(*) from step_requests where run_id = ?", [goodput]).fetchone()[0]
    assert num_req >= kinds["decode"]
    infos = [json.loads(i) for (i,) in con.execute(
        "select plan_info from steps where run_id = ? and kind = 'decode'", [goodput])]  # fmt: skip
    assert all("reason" in i for i in infos)


def test_shared_prefix_batch_shares_prefix_blocks_only():
    reqs, props, used = shared_prefix_batch(3, 12, 37, 16, 1, 256, 0, "cpu")
    shared = list(range(1, 3))  # positions 0..31 (the last cached token, 35, is in the third block)
    tails = [r.block_table[2:] for r in reqs]
    assert all(r.block_table[:2] == shared for r in reqs)
    assert len({b for t in tails for b in t}) == sum(map(len, tails)) == 3 * 2  # private, disjoint
    assert all(len(r.block_table) * 16 >= 37 + 12 and r.num_computed == 36 for r in reqs)
    assert props.num_draft == [12, 12, 12] and used == 2 + 6


def test_floor_inputs():
    m = random_model("tiny", torch.device("cpu"), torch.float32)
    cfg = m.cfg
    attn = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    per_layer = attn + mlp + 2 * cfg.hidden_size
    head = cfg.vocab_size * cfg.hidden_size
    want = 4 * (cfg.num_layers * per_layer + cfg.hidden_size + head)  # float32; the embedding is not streamed
    assert streamed_weight_bytes(m) == want
    assert copy_bandwidth(torch.device("cpu"), 1, iters=2) > 1e6


def scorer_row(batch: int, k: int, context: int, scorer: str, ms: float, vs_floor: float, path: str) -> dict:
    return dict(batch=batch, k=k, context=context, scorer=scorer, ms=ms, vs_floor=vs_floor, path=path) | {
        "error": ""
    }


SCORERS = {
    "model": "llama2-7b",
    "dtype": "bfloat16",
    "device": "GPU",
    "weight_bytes": 13e9,
    "copy_bandwidth": 4e12,
    "floor_ms": 3.25,
    "rows": [
        scorer_row(1, 3, 550, "batch_expansion", 3.9, 1.2, "graph"),
        scorer_row(1, 3, 550, "mqa", 13.0, 4.0, "eager"),
        scorer_row(1, 3, 550, "mqa_graph", 3.9, 1.2, "eager fallback: rows above largest bucket"),
        scorer_row(64, 3, 2048, "batch_expansion", 30.0, 9.2, "graph"),
        scorer_row(64, 3, 2048, "mqa_graph", 20.0, 6.2, "graph"),
    ],
    "draft_rows": [{"model": "llama-68m", "batch": 1, "graph_ms": 0.4, "eager_ms": 2.0}],
}


def e2e_row(config: str, proposer: str, tps: float, **kw) -> dict:
    row = dict(suite="synthetic", model="m", proposer=proposer, acceptance=0.6, batch=1, config=config)
    row |= dict(tokens_per_s=tps, ms_per_token=1e3 / tps, num_tokens=128, measured_acceptance=0.6, mean_k=3.0)
    row |= dict(scorer_steps={"mqa_graph": 40}, speedup=None, graph_fallbacks=0, note="", error="")
    return row | kw


def test_report_tables_and_targets():
    text = scorer_table(SCORERS)
    assert "| 1 | 3 | 550 | 3.900 (1.20×) | 13.000 (4.00×) | 3.900 (1.20×) [eager fallback: rows" in text
    assert "| 64 | 3 | 2048 | 30.000 (9.20×) | – | 20.000 (6.20×) | 1.50 |" in text
    e2e = [
        e2e_row("non-speculative", "none", 100.0),
        e2e_row("fixed k=3 mqa_graph", "synthetic", 210.0),
        e2e_row("policy goodput", "synthetic", 200.0),
        e2e_row("policy threshold", "synthetic", float("nan"), error="boom"),
    ]
    e2e_text = e2e_table(e2e)
    assert "| synthetic | m | synthetic | 1 | policy threshold | – |" in e2e_text
    assert "error: boom" in e2e_text
    targets = targets_table({"scorers": SCORERS, "e2e": e2e})
    lines = {line.split(" | ")[0].lstrip("| "): line for line in targets.splitlines()[2:]}
    assert lines["batch expansion (graph), batch 1, k 3, ctx 550: × floor"].endswith("| yes |")
    assert lines["MQA eager, batch 1, k 3, ctx 550: × floor"].endswith("| **no** |")
    assert "| 1.500 | ≥ 1.4 | yes |" in lines["batch 64, k 3, ctx 2048: BE ms / best MQA ms"]
    assert "| 0.050 | ≤ 0.03 | **no** |" in lines["e2e: largest lead of any config over goodput"]
    assert "| 2.000 | ≥ 1 | yes |" in lines["e2e: goodput / non-speculative, worst case"]
    assert lines["real model, batch 1: best tok/s"].endswith("| – |")
    run = {"date": "d", "device": "GPU", "command": "specsched-bench x", "scorers": SCORERS, "e2e": e2e}
    full = render(run | {"peers": [], "errors": {"peers": "ImportError: x"}})
    assert full.startswith("## specsched-bench, d, GPU") and "**peers failed**: `ImportError: x`" in full
    assert "### Targets (issue 5)" in full
    # a run without the scorer and e2e parts (bench=serve alone) has no issue-5 table of dashes
    assert "Targets (issue 5)" not in render({"date": "d", "device": "GPU", "command": "x", "e2e": []})


def test_peer_runner_on_a_tiny_transformers_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    assistant = LlamaForCausalLM(LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1})).eval()
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11]]

    class Cfg:
        methods = ["plain", "assistant", "prompt_lookup"]
        assistant_layers, prompt_lookup_num_tokens, max_new_tokens = 1, 3, 6

    rows = run_peers(model, assistant, prompts, Cfg)
    assert [r.method.split(",")[-1].strip() for r in rows] == [
        "transformers generate (plain)", "assistant_model = first 1 layers", "prompt_lookup_num_tokens=3"
    ]  # fmt: skip
    for r in rows:
        assert not r.error, r.error
        assert r.num_tokens == 2 * 6 and r.num_prompts == 2
        assert r.tokens_per_s > 0 and not math.isnan(r.ms_per_token)
    Cfg.methods = ["beam"]
    with pytest.raises(ValueError, match="unknown 'beam'; known: plain, assistant, prompt_lookup"):
        run_peers(model, assistant, prompts, Cfg)


def test_the_scorer_bench_can_run_the_fused_linear_layers_and_says_so():
    """``bench.scorers.fused_linear`` (and ``_gemms``) turn the model's option on before the scorers
    are built, and the table's note names it. (On the CPU the fused path itself does not run: forwards
    take it on CUDA or under the Triton interpreter.)"""
    import torch

    from specsched.bench.scorers import run_scorer_bench
    from specsched.models import llama

    built = []
    real = llama.LlamaForCausalLM.set_fused_linear

    def spy(self, on, gemms=False):
        built.append((on, gemms))
        return real(self, on, gemms)

    cfg = smoke_cfg("bench.scorers.fused_linear=true", "bench.scorers.fused_linear_gemms=true",
                    "bench.scorers.draft_model=null")  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama.LlamaForCausalLM, "set_fused_linear", spy)
        res = run_scorer_bench(cfg.scorers, cfg.graphs, torch.device("cpu"), torch.float32, 16, 0)
    assert built == [(True, True)]
    assert res["fused_linear"] == "with its output / down GEMMs" and res["rows"]
    assert "fused small-M linear layers (with its output / down GEMMs)" in scorer_table(res)
    plain = smoke_cfg("bench.scorers.draft_model=null")
    res = run_scorer_bench(plain.scorers, plain.graphs, torch.device("cpu"), torch.float32, 16, 0)
    assert res["fused_linear"] is False and "fused small-M" not in scorer_table(res)


def test_the_scorer_bench_builds_its_graphs_with_pdl_on_and_turns_it_off_after():
    """``bench.scorers.pdl`` holds ``model.pdl``'s switch on while the scorers (their graphs) are
    built and timed, and restores it; the result says whether it took effect (never on the CPU)."""
    import torch

    import specsched.bench.scorers as scorer_bench
    from specsched.kernels.pdl import is_pdl_enabled

    seen = []
    real = scorer_bench.build_scorers

    def spy(*args, **kwargs):
        seen.append(is_pdl_enabled())
        return real(*args, **kwargs)

    cfg = smoke_cfg("bench.scorers.pdl=true", "bench.scorers.draft_model=null")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scorer_bench, "build_scorers", spy)
        cpu = torch.device("cpu")
        res = scorer_bench.run_scorer_bench(cfg.scorers, cfg.graphs, cpu, torch.float32, 16, 0)
    assert seen == [True] and not is_pdl_enabled()
    assert res["pdl"] is False and res["rows"]  # the CPU launches no PDL


def test_a_failing_piecewise_capture_leaves_the_other_scorer_rows():
    """The piecewise row is built apart: when its capture fails, its rows say why and every other
    scorer's rows are still measured."""
    import torch

    import specsched.bench.scorers as scorer_bench

    def broken(*args, **kwargs):
        raise RuntimeError("capture failed")

    cfg = smoke_cfg("bench.scorers.draft_model=null")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scorer_bench, "build_piecewise_runner", broken)
        cpu = torch.device("cpu")
        res = scorer_bench.run_scorer_bench(cfg.scorers, cfg.graphs, cpu, torch.float32, 16, 0)
    by_scorer = {}
    for r in res["rows"]:
        by_scorer.setdefault(r["scorer"], []).append(r)
    assert all(r["path"] == "error" and "capture failed" in r["error"] for r in by_scorer["mqa piecewise"])
    for name in ("batch_expansion", "mqa", "mqa_graph"):
        assert by_scorer[name] and all(r["ms"] > 0 and not r["error"] for r in by_scorer[name]), name


def test_the_bench_warm_up_covers_the_target_and_a_wrapped_draft(monkeypatch):
    """``warm_up_spec`` runs the daemon's start-up warm-up for a bench's engines: the target's forwards
    and those of the real draft the synthetic proposer wraps (forced on here: on CPU it is off, as in
    the daemon)."""
    import specsched.engine.warmup as warmup
    from specsched.bench.common import EngineSpec, warm_up_spec
    from specsched.proposers.draft import DraftModelProposer
    from specsched.proposers.none import NoProposer
    from specsched.proposers.synthetic import SyntheticProposer
    from specsched.scorers.graph import GraphConfig
    from specsched.scorers.registry import build_scorers

    cpu = torch.device("cpu")
    target, draft = random_model("tiny", cpu, torch.float32, 0), random_model("tiny", cpu, torch.float32, 1)
    kv = target.allocate_kv_cache(64, 4)
    scorers = build_scorers(["mqa"], target, kv, 4, GraphConfig(enabled=False))
    spec = EngineSpec(target, kv, 64, 4, scorers, 2, 3, 64, [2], scheduler={"max_num_batched_tokens": 32})
    drafter = DraftModelProposer(draft, draft.allocate_kv_cache(64, 4), 4)
    synth = SyntheticProposer(target, 0.5, 4, draft=drafter)
    assert warm_up_spec(spec, {"none": NoProposer(cpu), "synthetic": synth}) is None  # off on CPU
    monkeypatch.setattr(warmup, "is_warmup_on", lambda cfg, device: True)
    report = warm_up_spec(spec, {"none": NoProposer(cpu), "synthetic": synth})
    assert report is not None and report.num_forwards > 0
    only_target = warm_up_spec(spec, {"none": NoProposer(cpu)})
    assert report.num_forwards == 2 * only_target.num_forwards  # the draft's forwards too


def test_bench_engines_prefill_on_graphs_as_the_daemon_does():
    """``graphs.prefill_tokens`` gives the bench's engines the daemon's prefill graphs (emulated
    here): prefill chunks replayed, greedy output that of eager prefill; 0 keeps prefill eager.
    Without it a regret window ran every refill's prefill eagerly (7B pair on an H100: 13-14 ms of
    host launches for one 128-token prompt), a cost the daemon does not pay."""
    from omegaconf import OmegaConf

    from specsched.bench.common import EngineSpec, graph_config, make_engine
    from specsched.engine.request import SamplingParams
    from specsched.policies.fixed import FixedConfig, FixedPolicy
    from specsched.proposers.none import NoProposer
    from specsched.scorers.graph import GraphConfig, build_prefill_runner
    from specsched.scorers.registry import build_scorers

    cpu = torch.device("cpu")
    target = random_model("tiny", cpu, torch.float32, 0)
    kv = target.allocate_kv_cache(64, 4)
    section = OmegaConf.create({"enabled": True, "emulate": True, "progress": False, "prefill_tokens": 32})
    gcfg = graph_config(section, 2, 3, 64)
    assert (gcfg.prefill_rows, gcfg.prefill_tokens) == (2, 32)  # 16 prompts cut to the batch bound
    off = graph_config(OmegaConf.merge(section, {"prefill_tokens": 0}), 2, 3, 64)
    assert build_prefill_runner(target, kv, 4, off) is None

    def engine(runner):
        scorers = build_scorers(["mqa"], target, kv, 4, GraphConfig(enabled=False))
        spec = EngineSpec(target, kv, 64, 4, scorers, 2, 3, 64, [2], prefill_runner=runner)
        policy = FixedPolicy(FixedConfig(k=0, scorer="mqa"))
        return make_engine(spec, {"none": NoProposer(cpu)}, "none", policy)

    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 5, [12, 13] * 4]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = engine(None).generate(prompts, params)
    runner = build_prefill_runner(target, kv, 4, gcfg)
    with_graphs = engine(runner)
    assert with_graphs.prefill_runner is runner
    assert with_graphs.generate(prompts, params) == want
    assert runner.num_replays > 0 and runner.num_eager_fallbacks == 0
