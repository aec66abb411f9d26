"""``specsched-bench``: the hydra app that runs the scorer micro-benchmark, the end-to-end suites and
the peers in one process, prints the markdown tables, writes ``results.json`` + ``tables.md`` to
``bench.out_dir`` and appends the tables to ``bench.append_to`` (docs/benchmarks.md).

Every axis is a config value (``conf/bench/default.yaml``), e.g.
``specsched-bench bench.scorers.batch=[1,8,64] bench.e2e.enabled=false``; ``bench=smoke`` is the
CPU smoke run of the tests, ``bench=h200_quick`` the ~6 minute GPU grid of ``bench/run_gpu.sh``.
Each part is guarded: a failing part is reported and the others still run.
"""

from __future__ import annotations

import gc
import json
import logging
import shlex
import sys
import time
import traceback
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from specsched.bench.common import device_name
from specsched.bench.report import append_markdown, now, render
from specsched.models.loader import resolve_device, resolve_dtype

logger = logging.getLogger("specsched.bench")


def run_bench(cfg: DictConfig, command: str) -> dict:
    """Run the enabled parts of ``cfg`` (the ``bench`` node); returns the results (also written out)."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)
    results: dict = {"date": now(), "device": device_name(device), "command": command,
                     "config": OmegaConf.to_container(cfg, resolve=True), "errors": {}}  # fmt: skip

    def part(name: str, fn) -> None:
        t0 = time.perf_counter()
        logger.info("=== %s ===", name)
        try:
            results[name] = fn()
        except Exception as e:  # one failing part must not stop the others
            logger.error("bench part %s FAILED:\n%s", name, traceback.format_exc())
            results["errors"][name] = f"{type(e).__name__}: {e}"[:500]
        finally:
            gc.collect()  # the part's model, caches and graphs go before the next part allocates
            if device.type == "cuda":
                torch.cuda.empty_cache()
            logger.info("=== %s done in %.1f s ===", name, time.perf_counter() - t0)
            write_outputs(results, cfg, final=False)  # a run killed later still leaves these parts

    if cfg.scorers.enabled:
        from specsched.bench.scorers import run_scorer_bench

        args = (cfg.graphs, device, dtype, cfg.block_size, cfg.seed)
        part("scorers", lambda: run_scorer_bench(cfg.scorers, *args))
    if cfg.e2e.enabled:
        from specsched.bench.e2e import rows_as_dicts
        from specsched.bench.suites import run_synthetic_suite

        args = (cfg.graphs, device, dtype, cfg.block_size, cfg.seed)
        part("e2e", lambda: rows_as_dicts(run_synthetic_suite(cfg.e2e, *args)))
    if cfg.real.enabled:
        from specsched.bench.e2e import rows_as_dicts
        from specsched.bench.suites import run_real_suite

        args = (cfg.graphs, device, dtype, cfg.block_size, cfg.seed)
        part("real", lambda: rows_as_dicts(run_real_suite(cfg.real, *args)))
    if cfg.peers.enabled:
        from specsched.bench.peers import run_peer_suite

        part("peers", lambda: run_peer_suite(cfg.peers, device, dtype))
    if cfg.serve.enabled:
        from specsched.bench.serve import run_serve_bench

        part("serve", lambda: run_serve_bench(cfg.serve, cfg.out_dir or "."))
    if cfg.regret.enabled:
        from specsched.bench.regret import run_regret

        def checkpoint(partial: dict) -> None:  # after each cell: a run cut short keeps its cells
            results["regret"] = partial
            write_outputs(results, cfg, final=False)

        args = (cfg.graphs, device, dtype, cfg.block_size, cfg.seed)
        part("regret", lambda: run_regret(cfg.regret, *args, on_cell=checkpoint))
    write_outputs(results, cfg, final=True)
    return results


def write_outputs(results: dict, cfg: DictConfig, final: bool) -> str:
    """``results.json`` + ``tables.md`` in ``out_dir`` (after every part); when ``final``, print the
    tables and append them to ``append_to``."""
    text = render(results)
    if results.get("regret"):  # bench/regret.py renders its own tables
        text += "\n" + results["regret"]["markdown"]
    out = Path(cfg.out_dir or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "tables.md").write_text(text)
    if final:
        print(text, flush=True)
        if cfg.append_to:
            logger.info("tables appended to %s", append_markdown(text, cfg.append_to))
    return text


@hydra.main(config_path="conf", config_name="bench", version_base=None)
def _app(cfg: DictConfig) -> None:
    run_bench(cfg.bench, shlex.join(["specsched-bench", *sys.argv[1:]]))


def main() -> None:
    """Console-script entry point (``specsched-bench``)."""
    _app()


if __name__ == "__main__":
    main()
