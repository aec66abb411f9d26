"""``bench=serve``: the real daemon (``python -m specsched.daemon``) as a subprocess per config, driven
by N concurrent protocol clients (bench/serve_load.py); tables in bench/serve_report.py.

For each config (hydra overrides of the daemon): start it on a free loopback port, time start-up
(process start until ``health`` answers ok), send ``warmup_requests`` untimed requests, then
``passes`` passes, each over every concurrency N in ``concurrency`` (``num_requests`` requests, at
least N; or, with ``duration_s``, a timed closed loop: staggered start, ramp, window), then SIGTERM.
The baseline config (non-speculative) runs first; its pass-1 outputs per (N, prompt) are the
reference of every row's ``same_output``: full-length requests only (a timed pass's cut-short first
requests are neither references nor compared), and its timed pass 1 goes on after the window until
every client has sent each prompt of its sequence at full length, so every prompt a later config
sends at that N has a reference. A daemon that fails to start gives a row saying so; the other
configs still run. Each daemon's stdout/stderr: ``<out_dir>/serve_logs/``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specsched.bench.common import random_prompts
from specsched.bench.prompts import NUM_GENERAL, PROMPTS
from specsched.bench.serve_config import DaemonRun, ServeConfig
from specsched.bench.serve_daemon import (
    Daemon,
    config_info,
    daemon_env,
    daemon_overrides,
    engine_cpu,
    prepare_weights,
    safe_name,
    split_cpus,
    start_up,
)
from specsched.bench.serve_drift import drift_table, log_loops, round_host_ms, with_indices
from specsched.bench.serve_host import host_counters, host_phase_rows, step_mix_row
from specsched.bench.serve_load import cycle_length, load_procs, run_pass
from specsched.bench.serve_outputs import add_references, pass_row
from specsched.bench.serve_paired import serve_by_prompt_rows
from specsched.bench.serve_plans import plan_rows
from specsched.bench.serve_requests import FILE_NAME as REQUESTS_FILE
from specsched.bench.serve_requests import daemon_times, read_rows
from specsched.bench.serve_requests import report as requests_report
from specsched.bench.serve_results import PassResult, same_mix_rates, split_interleaved
from specsched.bench.serve_rounds import replica_run
from specsched.bench.serve_shapes import shape_rows
from specsched.client.sync_client import Client

logger = logging.getLogger(__name__)


def make_prompts(cfg: ServeConfig) -> list[dict]:
    """The generate arguments of each prompt: ``messages`` (chat) or ``prompt_ids``."""
    if cfg.prompts == "ids":
        ids = random_prompts(cfg.prompt_vocab, cfg.num_prompts, cfg.prompt_len, cfg.seed, motif=True)
        return [{"prompt_ids": p} for p in ids]
    indices = (
        cfg.prompt_indices
        if cfg.prompt_indices is not None
        else [i % NUM_GENERAL for i in range(cfg.num_prompts)]
    )
    return [{"messages": PROMPTS[i]} for i in indices]


def write_oracle(path: Path, prompts: list[dict], reference: dict[int, dict[int, list[int]]]) -> Path:
    """The baseline's greedy outputs (at the lowest N) for the synthetic proposer:
    ``{"prompts": [[ids]], "outputs": [[ids]]}``."""
    ref = reference[min(reference)]
    idx = sorted(ref)
    path.write_text(json.dumps({"prompts": [prompts[i]["prompt_ids"] for i in idx],
                                "outputs": [ref[i] for i in idx]}))  # fmt: skip
    return path


def run_config(
    cfg: ServeConfig, run: DaemonRun, prompts: list[dict], out_dir: Path, log_dir: Path | None,
    reference: dict[int, dict[int, list[int]]] | None, progress, extra: list[str],
    daemon_cpus: set[int] | None = None,
) -> tuple[dict, list[dict]]:  # fmt: skip
    """One daemon: start-up, warm-up, the passes. Returns its config row and its table rows; fills
    ``reference`` (N -> prompt -> ids) from pass 1 when it is an empty dict (the baseline)."""
    rows: list[dict] = []
    daemon = Daemon(daemon_overrides(cfg, run, log_dir, extra), out_dir / f"{safe_name(run.name)}.log",
                    daemon_env(cfg, run), daemon_cpus)  # fmt: skip
    info = config_info(run, daemon)
    fill = reference is not None and not reference
    try:
        start_up(cfg, run.name, daemon, prompts, info)
        for p, n, res, slice_rates in passes_of(cfg, daemon, prompts, fill, progress, run.name):
            if fill and p == 1:
                add_references(reference.setdefault(n, {}), res)
            ref = None if reference is None or not reference else reference.get(n)
            head = {"config": run.name, "kind": run.kind, "concurrency": n, "pass": p}
            rows.append({**pass_row(head, [res], ref), "slice_tok_s": slice_rates})
            if res.error:
                raise RuntimeError(f"pass {p}, concurrency {n}: {res.error}; see {daemon.log_file}")
        with Client(daemon.endpoint, timeout_s=cfg.request_timeout_s) as c:
            stats = c.stats()
        info["compiles_total"] = getattr(stats, "num_compiles_after_start", None)
        info["host"] = host_counters(stats)
    except Exception as e:
        logger.error("serve %s failed: %s", run.name, e)
        info["error"] = f"{type(e).__name__}: {e}"[:1000]
    finally:
        info["exit_status"] = daemon.stop(cfg.stop_timeout_s)
    return info, rows


def passes_of(cfg: ServeConfig, daemon: Daemon, prompts: list[dict], fill: bool, progress, name: str):
    """(pass, N, PassResult, slice tok/s or None) of every pass of one daemon: pass 1 at every N, then
    pass 2, ...; or, with ``interleave_s``, per N one loop of passes x duration_s whose requests are dealt
    to the passes in turn (``cover`` then on the loop, which gives pass 1's references)."""

    def loop(n: int, duration_s: float, cover: bool) -> PassResult:
        return run_pass(daemon.endpoint, prompts, max(cfg.num_requests, n), n, cfg.max_tokens,
                        cfg.request_timeout_s, daemon.is_alive, duration_s, cfg.ramp_s,
                        cover=cover, procs=load_procs(n, cfg.clients_per_proc))  # fmt: skip

    if cfg.interleave_s and cfg.duration_s:
        progress.set_postfix_str(f"{name} passes 1-{cfg.passes} interleaved")
        for n in cfg.concurrency:
            res = loop(n, cfg.passes * cfg.duration_s, fill)
            if res.error:  # the loop failed: no slices to split; report it as pass 1
                yield 1, n, res, None
                return
            period = cycle_length(n, len(prompts))
            parts, rates = split_interleaved(res, cfg.passes, period, cfg.interleave_s)
            for p, part in enumerate(parts, 1):
                yield p, n, part, rates
        progress.update(cfg.passes)
        return
    for p in range(1, cfg.passes + 1):
        progress.set_postfix_str(f"{name} pass {p}")
        for n in cfg.concurrency:
            yield p, n, loop(n, cfg.duration_s, fill and p == 1), None
        progress.update(1)


def add_spread(rows: list[dict]) -> None:
    """``spread_raw`` = |tok/s - pass 1's| / pass 1's, on the rows of later passes; ``spread`` the same
    on the passes' same-prompt-mix tok/s (``same_mix_tok_s``, :func:`same_mix_rates`) where the
    passes were dealt from the same loops, else the raw one."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["concurrency"]), []).append(r)
    for group in groups.values():
        group.sort(key=lambda r: r["pass"])
        mixes = [r.get("prompt_mix") for r in group]
        same = same_mix_rates(mixes) if len(group) > 1 and all(mixes) else None
        for i, r in enumerate(group):
            r["same_mix_tok_s"] = same[i] if same else None
            r["spread_raw"] = _rel(r["tokens_per_s"], group[0]["tokens_per_s"]) if i else None
            r["spread"] = (_rel(same[i], same[0]) if same else r["spread_raw"]) if i else None


def _rel(x: float, base: float) -> float | None:
    return abs(x - base) / base if base else None


def run_serve_bench(section: DictConfig, out_dir: str | Path) -> dict:
    """``bench.serve``: every config, both passes; returns ``{"configs", "rows", ...}``."""
    cfg = ServeConfig.from_dictconfig(section)
    out = Path(out_dir) / "serve_logs"
    out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(cfg.log_dir).resolve() if cfg.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    weights = prepare_weights(cfg) if cfg.prepare_weights else None
    prompts = make_prompts(cfg)
    has_baseline = any(c.kind == "baseline" for c in cfg.configs)
    reference: dict | None = {} if has_baseline else None
    configs, rows, extra, host = [], [], [], []
    daemon_cpus, client_cpus = split_cpus(cfg.pin_cpus)
    own_cpus = os.sched_getaffinity(0) if client_cpus else None
    if client_cpus:
        logger.info("serve: daemons on cores %s, clients on %s", sorted(daemon_cpus), sorted(client_cpus))
        os.sched_setaffinity(0, client_cpus)
    try:
        if cfg.rounds:
            _run_in_rounds(cfg, prompts, out, log_dir, reference, configs, rows, daemon_cpus, host)
        else:
            _run_all(cfg, prompts, out, log_dir, reference, configs, rows, extra, daemon_cpus, host)
    finally:
        if own_cpus:
            os.sched_setaffinity(0, own_cpus)
    add_spread(rows)
    result = {"configs": configs, "rows": rows, "warm_start": None, "host_phases": host, "weights": weights,
              "cpus": {"daemon": sorted(daemon_cpus or []), "clients": sorted(client_cpus or []),
                       "engine": engine_cpu(daemon_cpus)},
              "settings": {k: v for k, v in OmegaConf.to_container(section, resolve=True).items()
                           if k != "configs"}}  # fmt: skip
    if log_dir is not None:  # each policy against the first fixed row, by prompt (bench/serve_paired.py)
        logs = {c.name: (c.kind, log_dir / f"{safe_name(c.name)}.sqlite") for c in cfg.configs}
        found = serve_by_prompt_rows(logs, cfg.concurrency)
        if found is not None:  # the table, and its rows for pooling runs (bench/serve_runs.py)
            result["by_prompt"], result["by_prompt_rows"] = found
        if cfg.rounds:  # the host's speed loop by loop, every daemon (replicas too: bench/serve_drift.py)
            names = [replica_run(c, k).name for c in cfg.configs for k in range(cfg.replicas)]
            loops = [lp for name in names for lp in log_loops(log_dir / f"{safe_name(name)}.sqlite")]
            result["drift"] = drift_table(with_indices(loops))
            for r in rows:  # each round's host ms beside its tok/s (the report's per-round targets)
                if r.get("round_tok_s"):
                    r["round_host_ms"] = round_host_ms(loops, safe_name(r["config"]), r["concurrency"],
                                                       len(r["round_tok_s"]))  # fmt: skip
    if cfg.rounds and cfg.interleave_s and (out / REQUESTS_FILE).exists():  # bench/serve_requests.py
        times = daemon_times(sorted(log_dir.glob("*.sqlite"))) if log_dir is not None else None
        result["requests"] = requests_report(read_rows(out / REQUESTS_FILE), times)
    first = next((c for c in configs if c["startup_s"] is not None), None)
    if cfg.warm_start and first is not None:
        result["warm_start"] = warm_start(cfg, first["name"], out, daemon_cpus)
    return result


def _run_all(cfg: ServeConfig, prompts, out: Path, log_dir, reference, configs: list, rows: list,
             extra: list, daemon_cpus: set[int] | None, host: list) -> None:  # fmt: skip
    from tqdm import tqdm

    with tqdm(total=len(cfg.configs) * cfg.passes, desc="serve configs x passes", unit="pass") as bar:
        for run in cfg.ordered:
            info, r = run_config(cfg, run, prompts, out, log_dir, reference, bar, extra, daemon_cpus)
            if run.kind == "baseline" and info["error"]:
                reference = None  # no reference: same_output is "–" for the rest
            elif run.kind == "baseline" and cfg.oracle_override:
                extra = [f"{cfg.oracle_override}={write_oracle(out / 'oracle.json', prompts, reference)}"]
            configs.append(info)
            rows += r
            if log_dir is not None:
                path = log_dir / f"{safe_name(run.name)}.sqlite"
                host += host_phase_rows(path, run.name, cfg.concurrency)
                info["step_mix"] = step_mix_row(path, run.name)
                info["shapes"] = shape_rows(path, run.name, cfg.concurrency)
                info["plans"] = plan_rows(path, run.name, cfg.concurrency)
            bar.n = (len(configs)) * cfg.passes  # a failed config skips its passes
            bar.refresh()
            # what is done so far, for a run stopped at a time limit before the part's results are written
            (out / "partial.json").write_text(json.dumps({"configs": configs, "rows": rows}, default=str))


def _run_in_rounds(cfg: ServeConfig, prompts, out: Path, log_dir, reference, configs: list, rows: list,
                   daemon_cpus: set[int] | None, host: list) -> None:  # fmt: skip
    from tqdm import tqdm

    from specsched.bench.serve_rounds import run_rounds

    def checkpoint(infos: list[dict], got: list[dict]) -> None:  # every N done so far, for a run cut short
        settings = {k: v for k, v in vars(cfg).items() if k != "configs"}
        add_spread(got)
        partial = {"configs": infos, "rows": got, "settings": settings, "is_partial": True}
        (out / "partial.json").write_text(json.dumps(partial, default=str))

    desc = f"serve: N x {cfg.rounds_per_n or cfg.rounds} rounds of every config"
    with tqdm(total=len(cfg.concurrency), desc=desc, unit="N") as bar:
        infos, got = run_rounds(cfg, prompts, out, log_dir, reference, bar, daemon_cpus, checkpoint)
    configs += infos
    rows += got
    for info in infos:
        if log_dir is not None and info["startup_s"] is not None:
            path = log_dir / f"{safe_name(info['name'])}.sqlite"
            host += host_phase_rows(path, info["name"], cfg.concurrency)
            info["step_mix"] = step_mix_row(path, info["name"])
            info["shapes"] = shape_rows(path, info["name"], cfg.concurrency)
            info["plans"] = plan_rows(path, info["name"], cfg.concurrency)
    (out / "partial.json").write_text(json.dumps({"configs": configs, "rows": rows}, default=str))


def warm_start(cfg: ServeConfig, name: str, out: Path, daemon_cpus: set[int] | None = None) -> dict:
    """Start ``name`` once more (the model files and compile caches warm now) and time it."""
    run = next(c for c in cfg.configs if c.name == name)
    daemon = Daemon(daemon_overrides(cfg, run, None), out / f"{safe_name(name)}.warm.log",
                    daemon_env(cfg, run), daemon_cpus)  # fmt: skip
    res = {"config": name, "startup_s": None, "error": None, "pid": daemon.pid}
    try:
        res["startup_s"] = daemon.wait_ready(cfg.startup_timeout_s)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        daemon.stop(cfg.stop_timeout_s)
    return res
