"""engine/graph_report.py: every graph runner an engine holds, by name, with its replays and eager
fallbacks, and the daemon's ``stats`` (``engine.graphs``) carrying them; nothing without graphs."""

from __future__ import annotations

import random

import msgpack

from specsched.daemon.stats_reply import engine_counters
from specsched.engine.graph_report import graph_runners, graph_stats
from specsched.engine.request import SamplingParams
from tests.scorers.test_graph_scorers import graph_engine, random_prompts


def test_an_engine_on_graphs_reports_each_runner_once_with_its_replays():
    engine, draft_fwd = graph_engine("cpu", "mqa_graph", "draft", graphs=True, seed=3, draft_loop=True)
    rng = random.Random(2)
    prompts = random_prompts(rng, 4)
    engine.generate(prompts, [SamplingParams(max_tokens=9, ignore_eos=True) for _ in prompts])
    runners = graph_runners(engine)
    assert runners["proposer draft"] is draft_fwd.runner
    assert runners["proposer draft loop"] is engine.proposers["draft"].loop_graphs
    # batch expansion and the MQA graph share the target's runner: one entry named by both
    assert runners["scorers batch_expansion+mqa_graph"] is engine.scorers["mqa_graph"].runner
    assert len({id(r) for r in runners.values()}) == len(runners)  # no runner twice
    stats = graph_stats(engine)
    assert stats["scorers batch_expansion+mqa_graph"]["num_replays"] > 0
    assert stats["proposer draft loop"]["num_replays"] > 0
    assert stats["proposer draft loop"]["num_misses"] == 0
    counters = engine_counters(engine)
    assert counters["graphs"] == stats and msgpack.unpackb(msgpack.packb(counters)) == counters


def test_an_engine_without_graphs_reports_none():
    engine, _ = graph_engine("cpu", "mqa", "ngram", graphs=False)
    assert graph_stats(engine) == {} and "graphs" not in engine_counters(engine)
