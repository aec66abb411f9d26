"""``scheduler.decode_steps`` through the real daemon on loopback: streamed greedy tokens equal the
in-process engine's one step at a time, chunks carry a run's tokens together, and the log's steps say
how many forwards each ran."""

from __future__ import annotations

import json
import random
import sqlite3

import pytest

from specsched.client.sync_client import Client


def reference(options: dict, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch

    from specsched.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
    from specsched.engine.engine import Engine
    from specsched.engine.request import SamplingParams, SpecParams

    sched = {**options["scheduler"], "decode_steps": 1, "plain_decode_steps": 1}
    cfg = EngineConfig(
        model=ModelConfig(**options["model"]), cache=CacheConfig(**options["cache"]),
        scheduler=SchedulerConfig(**sched), spec=SpecConfig(**options["spec"]),
    )  # fmt: skip
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sampling, spec = SamplingParams(max_tokens=max_tokens), SpecParams(proposer="none")
        return Engine.from_config(cfg).generate(prompts, sampling, spec)
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("max_batch", [None, 1, "default"], ids=["any_batch", "alone", "default"])
def test_runs_of_plain_steps_stream_the_single_step_tokens(start_daemon, max_batch):
    """``alone``: scheduler.decode_steps_max_batch=1, each request served alone: still runs.
    ``default``: no scheduler option but the time cap (``plain_decode_ms``, off here: a loaded CPU's
    tiny forwards may take longer than it allows); a request without a proposer served alone runs
    ``scheduler.plain_decode_steps`` (8) at a time."""
    if max_batch == "default":
        sched = {"plain_decode_ms": None}
    elif max_batch is None:
        sched = {"decode_steps": 4}
    else:
        sched = {"decode_steps": 4, "decode_steps_max_batch": max_batch}
    d = start_daemon(scheduler=sched, log_db=True)
    rng = random.Random(4)
    # the requests ask for no proposer (an n-gram proposer without a match runs no runs: it may
    # have one after the next token, engine/multi_step.py)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    want = reference(d.options, prompts, 13)
    runs = 0
    with Client(d.endpoint, timeout_s=60) as c:
        for p, w in zip(prompts, want, strict=True):
            chunks = list(c.stream(prompt_ids=p, max_tokens=13, spec={"proposer": "none"}))
            assert [t for ch in chunks for t in ch.token_ids] == w
            runs += sum(len(ch.token_ids) > 1 and ch.proposed == 0 for ch in chunks)
            assert c.generate(prompt_ids=p, max_tokens=13, spec={"proposer": "none"}).token_ids == w
    assert runs > 0, "some chunk must carry a run's tokens"
    d.stop()
    db = sqlite3.connect(d.log_path)
    infos = [json.loads(i) for (i,) in db.execute("select plan_info from steps where plan_info is not null")]
    rows = db.execute("select batch_size, num_tokens, plan_info from steps where kind = 'decode'").fetchall()
    assert any(i.get("decode_steps", 1) > 1 for i in infos)
    for b, t, info in rows:  # a run scored one token per request per forward
        steps = json.loads(info).get("decode_steps", 1) if info else 1
        assert steps == 1 or t == b * steps
