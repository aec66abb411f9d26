"""``bench.serve.rounds`` > 0: every config's daemon up at once, the load moved between them in rounds.

Configs measured one after another are minutes apart, and the H200 host's speed drifts by more than
the margins the serving targets ask for: on 2026-12-04 the same tree and grid gave the
non-speculative row 5,712 tok/s at N = 16 at 07:40 and 4,593 at 08:14, so a few percent between two
rows of one run said nothing about the two configs. Here every daemon is started first (one at a
time, so each start-up time is its own), then for each N there are ``rounds`` rounds, and each round
runs one timed closed loop (bench/serve_load.py ``run_pass``: staggered start, ramp, window of
``duration_s``) per config, the configs in a seeded, balanced order (bench/round_design.py: each
config in each place and after each other config about equally often, never twice in a row): the
daemons not under load wait in their poll and take no GPU or core time, so every config is measured
across the same stretch of the host's time, and a drift hits each config's rounds alike. Round r is
pass r of the table; or, with ``interleave_s``, each loop (``passes`` x ``duration_s``) is dealt to
the passes as in the interleaved mode and each pass pools its share of every round: the passes then
differ only by what one daemon does differently within the same seconds, and each round's tok/s is
reported beside them (``round_tok_s``). The baseline's first round at each N also covers every
prompt of every client (its outputs are the references of ``same_output``, computed once all rounds
are done). Every daemon gets ``round_overrides`` (by default a fixed KV cache: a share of the GPU
memory still free at its start would shrink from daemon to daemon). With ``replicas`` R > 1 each
config has R daemons (replica k's decision log is ``<config>_replica_k.sqlite``; the log-based
tables read replica 1's), all started before the first round, and round r at the i-th N runs on
replica (r + i) mod R (:func:`replica_of`): a daemon's own host speed then shows in the rounds'
spread and in the replica table (bench/serve_replicas.py) instead of hiding in the config's mean.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from specsched.bench.round_design import round_orders
from specsched.bench.serve_config import DaemonRun, ServeConfig
from specsched.bench.serve_daemon import (
    Daemon,
    config_info,
    daemon_env,
    daemon_overrides,
    safe_name,
    start_up,
)
from specsched.bench.serve_host import host_counters
from specsched.bench.serve_load import cycle_length, load_procs, run_pass
from specsched.bench.serve_outputs import add_references, pass_row
from specsched.bench.serve_requests import FILE_NAME as REQUESTS_FILE
from specsched.bench.serve_requests import request_rows, write_rows
from specsched.bench.serve_results import PassResult, split_interleaved, summarize
from specsched.client.sync_client import Client

logger = logging.getLogger(__name__)


def replica_of(r: int, n_index: int, replicas: int) -> int:
    """The replica (0-based) that serves round ``r`` at the ``n_index``-th concurrency."""
    return (r + n_index) % replicas


def replica_run(run: DaemonRun, k: int) -> DaemonRun:
    """Replica ``k`` (0-based) of ``run``: the same overrides, its own name (its logs' file names)."""
    return run if k == 0 else replace(run, name=f"{run.name} replica {k + 1}")


def run_rounds(
    cfg: ServeConfig, prompts: list[dict], out: Path, log_dir: Path | None,
    reference: dict[int, dict[int, list[int]]] | None, progress, daemon_cpus: set[int] | None = None,
    on_n: Callable[[list[dict], list[dict]], None] | None = None,
) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """Every config of ``cfg`` in rounds (module docstring). Returns (config rows, table rows) as
    :func:`specsched.bench.serve.run_config` does for one daemon; fills ``reference`` (N -> prompt ->
    ids) from the baseline's first round when it is an empty dict. A config with its own
    ``reference`` is checked against that config's first round instead (which then covers every
    prompt, as the baseline's does). ``on_n(config rows, table rows)`` gets the rows of every N done
    so far after each N (without the same-output check, which needs every round): a device call cut
    at its time limit still returns them."""
    runs = cfg.ordered
    infos: dict[str, dict] = {}
    daemons: dict[str, list[Daemon]] = {}  # config -> its replicas' daemons
    results: dict[tuple[str, int], list[PassResult]] = {}
    served_by: dict[tuple[str, int], list[int]] = {}  # (config, N) -> each loop's replica (0-based)
    try:
        for k in range(cfg.replicas):  # one at a time: each start-up is measured alone
            for run in runs:
                if k and run.name not in daemons:  # its first replica failed: the config is out
                    continue
                info, daemon = _start(cfg, replica_run(run, k), prompts, out, log_dir, daemon_cpus)
                if k == 0:
                    infos[run.name] = info
                    if cfg.replicas > 1:
                        info["replicas"] = []
                else:
                    infos[run.name]["replicas"].append(info)
                if daemon is not None:
                    daemons.setdefault(run.name, []).append(daemon)
                elif k:  # a replica that failed takes its config out with it
                    infos[run.name]["error"] = f"replica {k + 1}: {info['error']}"
        kinds = {run.name: run.kind for run in runs}
        fill = reference is not None and not reference
        covering = set(cfg.referenced)  # first rounds that cover every prompt: they give references
        if fill:
            covering |= {name for name, kind in kinds.items() if kind == "baseline"}
        for i, n in enumerate(cfg.concurrency):
            live = [run.name for run in runs if run.name in daemons]
            for r, order in enumerate(round_orders(live, cfg.rounds_at(n), f"{cfg.seed}:{n}")):
                k = replica_of(r, i, cfg.replicas)
                for name in order:
                    if k >= len(daemons[name]):  # that replica failed to start: its config is out
                        continue
                    progress.set_postfix_str(f"N={n} round {r + 1}: {name}")
                    if _one_loop(cfg, name, daemons[name][k], infos, results, prompts, n,
                                 cover=r == 0 and name in covering):  # fmt: skip
                        served_by.setdefault((name, n), []).append(k)
            progress.update(1)
            if on_n is not None:
                rows = _rows_so_far(cfg, runs, results, served_by, n, len(prompts))
                on_n([infos[run.name] for run in runs], rows)
        for name, group in daemons.items():
            counts = []
            for k, daemon in enumerate(group):
                if daemon.is_alive():
                    with Client(daemon.endpoint, timeout_s=cfg.request_timeout_s) as c:
                        stats = c.stats()
                    counts.append(getattr(stats, "num_compiles_after_start", None))
                    (infos[name] if k == 0 else infos[name]["replicas"][k - 1])["host"] = host_counters(stats)
            if counts and None not in counts:
                infos[name]["compiles_total"] = sum(counts)
    finally:
        for name, group in daemons.items():
            for k, daemon in enumerate(group):
                info = infos[name] if k == 0 else infos[name]["replicas"][k - 1]
                info["exit_status"] = daemon.stop(cfg.stop_timeout_s)

    def first_round(name: str, into: dict[int, dict[int, list[int]]]) -> None:
        """``name``'s first-round outputs per N and prompt into ``into`` (N -> prompt -> ids)."""
        for n in cfg.concurrency:
            first = results.get((name, n), [])
            if first:
                add_references(into.setdefault(n, {}), first[0])

    baseline = next((run.name for run in runs if run.kind == "baseline"), None)
    if reference is not None and not reference and baseline is not None:
        first_round(baseline, reference)
    own: dict[str, dict[int, dict[int, list[int]]]] = {}  # referenced config -> N -> prompt -> ids
    for name in cfg.referenced:
        first_round(name, own.setdefault(name, {}))
    rows = []
    for run in runs:
        for n in cfg.concurrency:
            loops = results.get((run.name, n), [])
            if run.reference is not None:
                ref = own.get(run.reference, {}).get(n)
            else:
                ref = None if reference is None or not reference else reference.get(n)
            rows += _rows(cfg, run, n, loops, ref, len(prompts), served_by.get((run.name, n), []))
    # every timed request as its client saw it (bench/serve_requests.py)
    write_rows(out / REQUESTS_FILE, [
        row for run in runs for n in cfg.concurrency
        for row in request_rows(run.name, n, results.get((run.name, n), []), served_by.get((run.name, n), []),
                                cycle_length(n, len(prompts)))
    ])  # fmt: skip
    return [infos[run.name] for run in runs], rows


def _rows_so_far(
    cfg: ServeConfig, runs: list[DaemonRun], results: dict, served_by: dict, n: int, num_prompts: int
) -> list[dict]:
    """The table rows of every config at the concurrencies up to ``n``, without references."""
    done = cfg.concurrency[: cfg.concurrency.index(n) + 1]
    return [row for run in runs for m in done
            for row in _rows(cfg, run, m, results.get((run.name, m), []), None, num_prompts,
                             served_by.get((run.name, m), []))]  # fmt: skip


def _rows(
    cfg: ServeConfig, run: DaemonRun, n: int, loops: list[PassResult], ref, num_prompts: int,
    replicas: list[int],
) -> list[dict]:  # fmt: skip
    """The table rows of one (config, N): a row per round (its ``replica``), or with ``interleave_s`` a
    row per dealt pass pooled over the rounds (each loop's requests dealt to the passes,
    :func:`split_interleaved`), with every round's tok/s (``round_tok_s``) and replica
    (``round_replica``, 1-based), the engine thread's CPU taken away during each round's loop
    (``round_switches``: nonvoluntary context switches), the busiest load process's core share in it
    (``round_load_share``), the daemon's threads' CPU shares (``round_threads``) and every slice's
    tok/s (``slice_tok_s``) beside them."""
    head = {"config": run.name, "kind": run.kind, "concurrency": n}
    if not loops:  # the daemon never served (it failed to start): its config row says why
        return []
    if not cfg.interleave_s or any(loop.error or not loop.timed for loop in loops):
        groups = [[loop] for loop in loops]
        extra: dict = dict.fromkeys(("slice_tok_s", "round_tok_s", "round_replica", "round_switches",
                                     "round_load_share", "round_threads"))  # fmt: skip
        each = [{"replica": k + 1} for k in replicas] if cfg.replicas > 1 else [{}] * len(groups)
    else:
        period = cycle_length(n, num_prompts)
        split = [split_interleaved(loop, cfg.passes, period, cfg.interleave_s) for loop in loops]
        groups = [[parts[p] for parts, _ in split] for p in range(cfg.passes)]
        extra = {"slice_tok_s": [x for _, rates in split for x in rates],
                 "round_tok_s": [summarize(loop)["tokens_per_s"] for loop in loops],
                 "round_replica": [k + 1 for k in replicas] if cfg.replicas > 1 else None,
                 "round_switches": [loop.engine_switches for loop in loops],
                 "round_load_share": [loop.load_share for loop in loops],
                 "round_threads": [loop.thread_shares for loop in loops]}  # fmt: skip
        each = [{}] * len(groups)
    return [{**pass_row({**head, "pass": p}, parts, ref), **extra, **own}
            for p, (parts, own) in enumerate(zip(groups, each, strict=True), 1)]  # fmt: skip


def _start(
    cfg: ServeConfig, run: DaemonRun, prompts: list[dict], out: Path, log_dir: Path | None,
    daemon_cpus: set[int] | None,
) -> tuple[dict, Daemon | None]:  # fmt: skip
    overrides = daemon_overrides(cfg, run, log_dir, cfg.round_overrides)
    daemon = Daemon(overrides, out / f"{safe_name(run.name)}.log", daemon_env(cfg, run), daemon_cpus)
    info = config_info(run, daemon)
    try:
        start_up(cfg, run.name, daemon, prompts, info)
        return info, daemon
    except Exception as e:
        logger.error("serve %s failed: %s", run.name, e)
        info["error"] = f"{type(e).__name__}: {e}"[:1000]
        info["exit_status"] = daemon.stop(cfg.stop_timeout_s)
        return info, None


def _one_loop(cfg: ServeConfig, name: str, daemon: Daemon, infos: dict[str, dict],
              results: dict, prompts: list[dict], n: int, cover: bool) -> bool:  # fmt: skip
    """One timed loop of ``name`` at concurrency ``n`` on ``daemon`` (one of its replicas); a daemon
    that fails is reported and its config dropped. Whether a loop ran."""
    if infos[name]["error"] is not None:
        return False
    window = cfg.duration_s * (cfg.passes if cfg.interleave_s else 1)  # dealt passes share one loop
    res = run_pass(daemon.endpoint, prompts, max(cfg.num_requests, n), n, cfg.max_tokens,
                   cfg.request_timeout_s, daemon.is_alive, window, cfg.ramp_s, cover=cover,
                   procs=load_procs(n, cfg.clients_per_proc))  # fmt: skip
    results.setdefault((name, n), []).append(res)
    if res.error:
        infos[name]["error"] = f"RuntimeError: concurrency {n}: {res.error}; see {daemon.log_file}"[:1000]
        logger.error("serve %s failed: %s", name, res.error)
    return True
