from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.resources import files

import pytest
import yaml
from hydra import compose, initialize_config_module

from specsched.daemon.app_config import machine_device_type
from specsched.daemon.cli import (
    AppConfig,
    GenerateConfig,
    generate,
    register_configs,
    resolve,
    serve,
    summarize_steps,
    to_engine_config,
)
from specsched.daemon.log import open_log
from specsched.engine.config import EngineConfig
from specsched.engine.records import StepRecord, StepRequestRecord
from specsched.scorers.registry import default_scorer_names

BIN = os.path.dirname(sys.executable)
TINY = ["model=tiny", "cache.num_blocks=64", "model.device=cpu"]


def run_cli(script: str, *args: str, cwd, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run an installed console script (``python -m specsched.daemon`` for serve if not installed)."""
    exe = os.path.join(BIN, script)
    cmd = [exe, *args] if os.path.exists(exe) else [sys.executable, "-m", "specsched.daemon", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def run_in_process_raw(entry, args: list[str], monkeypatch, tmp_path) -> None:
    """Run an entry point in this process, in ``tmp_path`` (hydra reads ``sys.argv``)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["specsched", *args])
    entry()


def run_in_process(entry, args: list[str], monkeypatch, tmp_path) -> int:
    """Like :func:`run_in_process_raw`; returns the exit status (hydra exits 1 on a bad override)."""
    try:
        run_in_process_raw(entry, args, monkeypatch, tmp_path)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0


def compose_app(config_name: str = "config", overrides: list[str] = ()) -> AppConfig:
    register_configs()
    with initialize_config_module("specsched.conf", version_base="1.3"):
        return resolve(compose(config_name, overrides=list(overrides)))


def group_options(group: str) -> list[str]:
    return sorted(
        p.name[: -len(".yaml")]
        for p in files("specsched.conf").joinpath(group).iterdir()
        if p.name.endswith(".yaml")
    )


def test_cfg_job_prints_the_resolved_config_with_overrides(tmp_path):
    r = run_cli(
        "specsched-serve",
        "--cfg",
        "job",
        "model=tiny",
        "policy=goodput",
        "policy.k_margin=0.1",
        "daemon.endpoint=tcp://127.0.0.1:5600",
        "log.path=run.sqlite",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["model"]["source"] == "tiny"
    assert cfg["policy"]["name"] == "goodput" and cfg["policy"]["k_margin"] == 0.1
    assert cfg["daemon"]["endpoint"] == "tcp://127.0.0.1:5600"
    assert cfg["log"]["path"] == "run.sqlite"
    assert cfg["scorer"]["names"] == default_scorer_names(machine_device_type())  # this machine's
    assert os.listdir(tmp_path) == []  # no outputs/, no .hydra/, no log files


def test_default_scorers_follow_the_device_and_a_user_can_narrow_them(monkeypatch):
    import specsched.daemon.app_config as app_config

    assert default_scorer_names("cpu") == ["batch_expansion", "mqa"]
    monkeypatch.setattr(app_config, "machine_device_type", lambda: "cuda")
    assert compose_app(overrides=TINY).scorer.names == ["batch_expansion", "mqa", "mqa_graph"]
    assert compose_app(overrides=[*TINY, "scorer=mqa"]).scorer.names == ["mqa"]
    monkeypatch.setattr(app_config, "machine_device_type", lambda: "cpu")
    assert compose_app(overrides=TINY).scorer.names == ["batch_expansion", "mqa"]


def test_python_m_daemon_is_serve_and_fails_on_a_typo(tmp_path):
    cmd = [sys.executable, "-m", "specsched.daemon", "model.sourc=x"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode != 0
    assert "Key 'sourc' not in 'ModelConfig'" in r.stderr  # hydra's own message
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "entry, override, message",
    [
        (serve, "model.sourc=x", "Key 'sourc' not in 'ModelConfig'"),
        (serve, "policy=nonexistent", "Could not find 'policy/nonexistent'"),
        (serve, "policy.kk=1", "Could not override 'policy.kk'"),
        (generate, "max_token=5", "Key 'max_token' not in 'GenerateConfig'"),
    ],
)
def test_invalid_override_fails_with_hydras_message(monkeypatch, tmp_path, capsys, entry, override, message):
    assert run_in_process(entry, ["--cfg", "job", override], monkeypatch, tmp_path) != 0
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["model=hf"], "missing mandatory value(s): model.source"),
        (["model=tiny", "cache.block_size=3"], "cache.block_size must be a power of two"),
        (["model=tiny", "daemon.endpoint=http://x"], "daemon.endpoint must start with"),
    ],
)
def test_invalid_values_fail_at_start(monkeypatch, tmp_path, args, message):
    with pytest.raises(SystemExit) as e:
        run_in_process_raw(serve, args, monkeypatch, tmp_path)
    assert message in str(e.value.code)
    assert os.listdir(tmp_path) == []  # nothing started, no log created


def test_generate_config_errors_exit_cleanly(monkeypatch, tmp_path):
    with pytest.raises(SystemExit) as e:
        run_in_process_raw(generate, [*TINY, "prompt=hi"], monkeypatch, tmp_path)
    assert "has no tokenizer: pass prompt_ids" in str(e.value.code)


def test_mapping_onto_engine_config():
    app = compose_app(
        overrides=[
            "model=tiny",
            "proposer=synthetic",
            "proposer.max_k=3",
            "proposer.synthetic_acceptance=0.4",
            "scorer=mqa",
            "draft=tiny",
            "policy=threshold",
            "policy.batch_size=4",
            "scheduler.max_num_seqs=7",
            "scorer.graph_residual=false",
        ]
    )
    assert type(app) is AppConfig
    ec = to_engine_config(app)
    assert ec.spec.graph_residual is False and to_engine_config(compose_app()).spec.graph_residual is True
    assert isinstance(ec, EngineConfig)
    assert (ec.model.source, ec.spec.proposer, ec.spec.max_k, ec.spec.scorers) == (
        "tiny",
        "synthetic",
        3,
        ["mqa"],
    )
    assert ec.spec.synthetic_acceptance == 0.4 and ec.spec.draft.source == "tiny"
    assert ec.policy["name"] == "threshold" and ec.policy["batch_size"] == 4 and type(ec.policy) is dict
    assert ec.scheduler.max_num_seqs == 7


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["proposer.max_k=-1"], "proposer.max_k"),
        (["proposer.synthetic_acceptance=1.5"], "synthetic_acceptance"),
        (["scorer.names=[]"], "scorer.names"),
        (["draft.num_layers=0"], "draft.num_layers"),
        (["model.dtype=float8"], "model.dtype"),
        (["log.flush_interval_s=0"], "log.flush_interval_s"),
        (["policy=custom"], "policy._target_"),
    ],
)
def test_mapping_validates(overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        compose_app(overrides=overrides)


@pytest.mark.parametrize("group", ["model", "draft", "proposer", "scorer", "policy", "daemon", "log"])
def test_every_group_option_composes(group):
    options = group_options(group)
    assert options
    for option in options:
        overrides = [f"{group}={option}"]
        if (group, option) in {("model", "hf"), ("model", "gguf")}:
            overrides.append("model.source=/some/where")
        if (group, option) == ("policy", "custom"):
            overrides.append("policy._target_=my_pkg.MyPolicy")
        ec = to_engine_config(compose_app(overrides=overrides))
        if group == "policy" and option != "custom":
            from specsched.policies.registry import build_policy

            assert build_policy(ec.policy).name == option  # the yaml's options are the policy's own


def test_generate_config_needs_one_prompt():
    app = compose_app("generate", ["model=tiny", "prompt_ids=[1,2,3]"])
    assert type(app) is GenerateConfig and app.prompt_ids == [1, 2, 3] and app.log.path is None
    with pytest.raises(ValueError, match="prompt"):
        compose_app("generate", ["model=tiny"])
    with pytest.raises(ValueError, match="exactly one"):
        compose_app("generate", ["model=tiny", "prompt=hi", "prompt_ids=[1]"])


def test_summarize_steps():
    def step(i, kind, scorer, ks_acc, emitted):
        reqs = [StepRequestRecord(f"r{j}", 10, k, a) for j, (k, a) in enumerate(ks_acc)]
        return StepRecord(
            i,
            kind,
            0.0,
            len(reqs),
            0,
            scorer=scorer,
            policy="fixed" if scorer else None,
            total_ms=2.0,
            num_emitted=emitted,
            requests=reqs,
        )

    records = [
        step(0, "prefill", None, [], 2),
        step(1, "decode", "mqa", [(4, 4), (2, 0)], 6),
        step(2, "decode", "batch_expansion", [(0, 0), (2, 1)], 3),
        step(3, "decode", "mqa", [(1, 1)], 2),
    ]
    s = summarize_steps(records, wall_s=0.5)
    assert (s.num_steps, s.num_decode_steps, s.num_emitted) == (4, 3, 13)
    assert (s.num_proposed, s.num_accepted) == (9, 6)
    assert s.mean_k == pytest.approx(9 / 5) and s.acceptance == pytest.approx(6 / 9)
    assert s.scorer_steps == {"mqa": 2, "batch_expansion": 1} and s.policy_steps == {"fixed": 3}
    assert s.tokens_per_s == pytest.approx(26.0) and s.step_ms == pytest.approx(8.0)
    text = s.format()
    assert "mqa 2" in text and "66.7%" in text and "1.80" in text
    assert summarize_steps([], 0.0).acceptance is None


@pytest.mark.slow
def test_generate_end_to_end(tmp_path):
    from specsched.engine.engine import Engine
    from specsched.engine.request import SamplingParams

    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    overrides = [*TINY, f"prompt_ids=[{','.join(map(str, prompt))}]", "max_tokens=16", "log.path=g.sqlite"]
    r = run_cli("specsched-generate", *overrides, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    streamed = [int(t) for t in r.stdout.split()]
    # the same config in process, greedy: the CLI streamed exactly the engine's completion
    engine = Engine.from_config(to_engine_config(compose_app("generate", overrides)))
    (expected,) = engine.generate([prompt], SamplingParams(max_tokens=16))
    assert streamed == expected and 1 <= len(streamed) <= 16
    for label in ("steps", "mean k", "scorer mix", "acceptance", "tokens/s"):
        assert label in r.stderr
    db = open_log(tmp_path / "g.sqlite")
    (run,) = list(db["runs"].rows)
    assert json.loads(run["config"])["model"]["source"] == "tiny" and run["model"]
    assert db.execute("select sum(num_emitted) from steps").fetchone()[0] == len(streamed)
    (req,) = list(db["requests"].rows)
    assert req["output_tokens"] == len(streamed) and req["finish_reason"] in ("stop", "length")
    num_steps = db.execute("select count(*) from steps").fetchone()[0]
    assert f"steps       {num_steps} " in r.stderr
