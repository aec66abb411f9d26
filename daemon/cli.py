"""Console entry points (hydra): ``specsched-serve`` (the daemon) and ``specsched-generate`` (one prompt,
in process, streamed to the terminal, then a summary of the per-step decisions).

Configs live in ``conf/`` (installed as ``specsched.conf``); their dataclass schemas, registered in
hydra's ConfigStore so that a mistyped override fails at start with hydra's own message, are in
app_config.py (re-exported here); the entry points turn the composed config into those dataclasses and
map them onto :class:`~specsched.engine.config.EngineConfig` in :func:`to_engine_config`; no DictConfig
goes further. ``specsched-serve`` times its start-up (:class:`~specsched.engine.warmup.StartupTimes`,
from the process's start) and logs the breakdown when it listens; ``stats`` reports it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
import threading
import time
from collections.abc import Callable

import hydra
from omegaconf import DictConfig, OmegaConf

from specsched.daemon.app_config import (
    AppConfig,
    GenerateConfig,
    ProposerOptions,
    ScorerOptions,
    register_configs,
    resolve,
    to_engine_config,
)
from specsched.daemon.log import LogFormatError, LogWriter
from specsched.daemon.server import Server
from specsched.daemon.summary import StepSummary, summarize_steps
from specsched.engine.log_schema import prompt_hash
from specsched.engine.records import StepRecord
from specsched.engine.settings import load_settings
from specsched.engine.warmup import StartupTimes

CONFIG_PATH = "pkg://specsched.conf"
logger = logging.getLogger("specsched")
__all__ = [
    "AppConfig",
    "GenerateConfig",
    "ProposerOptions",
    "ScorerOptions",
    "StepSummary",
    "generate",
    "prompt_ids",
    "register_configs",
    "resolve",
    "serve",
    "summarize_steps",
    "to_engine_config",
    "version",
]


def version() -> str:
    try:
        return importlib.metadata.version("specsched")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _setup(cfg: DictConfig) -> AppConfig:
    settings = load_settings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings.apply_triton_cache()
    try:
        return resolve(cfg)
    except ValueError as e:
        sys.exit(f"specsched: invalid config: {e}")


def _import_ahead(app: AppConfig) -> None:
    """Import in a background thread, while the model loads, what the start-up needs only after it:
    ``sqlite_utils`` for the decision log's writer (~0.1-0.7 s: its import scans every installed
    package's entry points, files more than CPU). A failed import is left to the code that needs the
    module (it raises there)."""
    names = ["sqlite_utils"] if app.log.path is not None else []

    def run() -> None:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 -- the writer reports it when it opens the log
                logger.debug("importing %s ahead: %s", name, e)

    if names:
        threading.Thread(target=run, name="specsched-import-ahead", daemon=True).start()


def _open_log(app: AppConfig, cfg: DictConfig, engine) -> LogWriter | None:
    """The decision log with this run's row (its resolved config) written, or None for ``log=none``."""
    if app.log.path is None:
        return None
    log = LogWriter(app.log)
    model = getattr(engine, "model_name", app.model.source)
    device = str(getattr(engine, "device", app.model.device))
    config = OmegaConf.to_container(cfg, resolve=True)
    try:
        run_id = log.start_run(config, model=model, device=device, version=version())
    except LogFormatError as e:
        log.close()
        sys.exit(f"specsched: {e}; choose another log.path (or log=none)")
    logger.info("decision log %s, run %s", app.log.path, run_id)
    costs = getattr(engine, "costs", None)
    if costs is not None and not log.save_costs(costs):  # the graph buckets a replay pads to
        logger.warning("decision log %s: the start-up cost models were not saved", app.log.path)
    return log


def _serve(cfg: DictConfig, startup: StartupTimes | None = None) -> None:
    startup = startup or StartupTimes.since_process_start()
    app = _setup(cfg)
    startup.mark("config")
    _import_ahead(app)
    from specsched.engine.components import build_parts
    from specsched.engine.engine import Engine

    engine_cfg = to_engine_config(app)
    engine = Engine(engine_cfg, build_parts(engine_cfg, startup=startup))  # = Engine.from_config, timed
    log = _open_log(app, cfg, engine)
    startup.mark("log")
    try:
        Server(engine, app.daemon, log, startup).serve_forever()
    finally:
        if log is not None:
            log.close()


def _generate(cfg: DictConfig) -> None:
    app = _setup(cfg)
    assert isinstance(app, GenerateConfig)
    _import_ahead(app)
    from specsched.engine.engine import Engine
    from specsched.engine.request import Request, SamplingParams
    from specsched.models.detokenizer import IncrementalDetokenizer

    engine = Engine.from_config(to_engine_config(app))
    tok = engine.tokenizer
    try:
        sampling = SamplingParams(
            temperature=app.temperature,
            top_p=app.top_p,
            top_k=app.top_k,
            seed=app.seed,
            max_tokens=app.max_tokens,
        )
        req = Request("generate", prompt_ids(app, tok), sampling, arrival_time=time.time())
        engine.add_request(req)
    except ValueError as e:
        sys.exit(f"specsched: {e}")
    log = _open_log(app, cfg, engine)
    records: list[StepRecord] = []

    def on_step(rec: StepRecord) -> None:
        records.append(rec)
        if log is not None:
            log.write_step(rec)

    engine.on_step = on_step
    detok = IncrementalDetokenizer(tok) if tok is not None else None
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished:
            for out in engine.step():
                sys.stdout.write(
                    detok.push(out.new_token_ids) if detok else "".join(f" {i}" for i in out.new_token_ids)
                )
                sys.stdout.flush()
    except KeyboardInterrupt:
        engine.abort_request(req.request_id)
    wall_s = time.perf_counter() - t0
    print(detok.flush() if detok else "", flush=True)
    if log is not None:
        log.write_request(
            req.request_id,
            client=None,
            arrival=req.arrival_time,
            first_token_time=req.first_token_time,
            finish_time=time.time(),
            prompt_tokens=req.num_prompt_tokens,
            output_tokens=req.num_output_tokens,
            finish_reason=req.finish_reason,
            proposed=req.num_proposed,
            accepted=req.num_accepted,
            prompt_hash=prompt_hash(req.prompt_ids),
        )
        log.close()
    print(summarize_steps(records, wall_s).format(), file=sys.stderr)


def prompt_ids(app: GenerateConfig, tokenizer) -> list[int]:
    """The prompt's token ids: ``prompt_ids`` as given, else ``prompt`` through the chat template (when
    ``chat`` and the tokenizer has one) or plain encoding."""
    if app.prompt_ids is not None:
        return list(app.prompt_ids)
    if tokenizer is None:
        raise ValueError(
            f"model {app.model.source!r} has no tokenizer: pass prompt_ids=[...] instead of prompt"
        )
    if app.chat and tokenizer.has_chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": app.prompt}])
    return tokenizer.encode(app.prompt)


def _main(config_name: str, task: Callable[[DictConfig], None]) -> None:
    register_configs()
    hydra.main(config_path=CONFIG_PATH, config_name=config_name, version_base="1.3")(task)()


def serve(origin: float | None = None) -> None:
    """``specsched-serve [overrides]``: start the daemon (``--cfg job`` prints the resolved config).
    ``origin``: the entry point's first ``time.monotonic()``, the start-up clock where the process's
    start time cannot be read (/proc)."""
    startup = StartupTimes.since_process_start(origin)
    startup.mark("imports")
    _main("config", lambda cfg: _serve(cfg, startup))


def generate() -> None:
    """``specsched-generate prompt="..." [max_tokens=N] [overrides]``."""
    _main("generate", _generate)
