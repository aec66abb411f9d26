"""Console entry points (hydra): ``specsched-serve`` (the daemon) and ``specsched-generate`` (one prompt,
in process, streamed to the terminal, then a summary of the per-step decisions).

Configs live in ``conf/`` (installed as ``specsched.conf``); the dataclass schemas below are registered
in hydra's ConfigStore, so a mistyped override fails at start with hydra's own message. The entry
points turn the composed config into plain dataclasses (``OmegaConf.to_object``) and map them onto
:class:`~specsched.daemon.config.EngineConfig` in :func:`to_engine_config`; no DictConfig goes further.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from specsched.daemon.config import (
    CacheConfig,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    NgramConfig,
    SchedulerConfig,
    SpecConfig,
)
from specsched.daemon.log import LogConfig, LogFormatError, LogWriter
from specsched.daemon.records import StepRecord
from specsched.daemon.server import DaemonConfig, Server
from specsched.daemon.settings import load_settings

CONFIG_PATH = "pkg://specsched.conf"
logger = logging.getLogger("specsched")


@dataclass
class ProposerOptions:
    """The ``proposer`` group: which proposer and the engine's cap on k."""

    name: str = "ngram"  # none | ngram | draft | synthetic
    max_k: int = 8
    ngram: NgramConfig = field(default_factory=NgramConfig)
    synthetic_acceptance: float = 0.7  # proposer=synthetic only (benchmarks)

    def __post_init__(self) -> None:
        if self.max_k < 0:
            raise ValueError(f"proposer.max_k must be >= 0, got {self.max_k}")
        if not 0.0 <= self.synthetic_acceptance <= 1.0:
            raise ValueError(
                f"proposer.synthetic_acceptance must be in [0, 1], got {self.synthetic_acceptance}"
            )


@dataclass
class ScorerOptions:
    """The ``scorer`` group: the scorers built at start (the policy picks among them each step)."""

    names: list[str] = field(default_factory=lambda: ["batch_expansion", "mqa"])

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("scorer.names must name at least one scorer")


@dataclass
class AppConfig:
    """``specsched-serve``'s whole config (conf/config.yaml)."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(source=MISSING))  # the model group sets it
    draft: DraftConfig = field(default_factory=DraftConfig)
    proposer: ProposerOptions = field(default_factory=ProposerOptions)
    scorer: ScorerOptions = field(default_factory=ScorerOptions)
    policy: dict[str, Any] = field(
        default_factory=dict
    )  # {name: ..., options}: policies.registry.build_policy
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.policy.get("name", self.policy.get("_target_")), str):
            raise ValueError(
                f"policy needs a 'name' or a '_target_' (pick one with policy=<name>), got {self.policy}"
            )


@dataclass
class GenerateConfig(AppConfig):
    """``specsched-generate``'s config (conf/generate.yaml): the app config plus one prompt."""

    prompt: str | None = None  # text; through the chat template when ``chat`` and the model has one
    prompt_ids: list[int] | None = None  # token ids as they are (models without a tokenizer)
    chat: bool = True
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError('give exactly one of prompt="..." or prompt_ids=[...]')


def register_configs() -> None:
    """Register the schemas (group ``schema``, selected by conf/config.yaml and conf/generate.yaml)."""
    cs = ConfigStore.instance()
    cs.store(group="schema", name="serve", node=AppConfig)
    cs.store(group="schema", name="generate", node=GenerateConfig)


def to_engine_config(app: AppConfig) -> EngineConfig:
    """The one mapping from the app config onto the engine's."""
    spec = SpecConfig(
        proposer=app.proposer.name,
        scorers=list(app.scorer.names),
        max_k=app.proposer.max_k,
        ngram=app.proposer.ngram,
        draft=app.draft,
        synthetic_acceptance=app.proposer.synthetic_acceptance,
    )
    return EngineConfig(
        model=app.model, cache=app.cache, scheduler=app.scheduler, spec=spec, policy=dict(app.policy)
    )


def resolve(cfg: DictConfig) -> AppConfig:
    """Composed config -> validated dataclasses. Raises ``ValueError`` naming the bad or missing value."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(f"missing mandatory value(s): {', '.join(missing)} (e.g. {missing[0]}=...)")
    app = OmegaConf.to_object(cfg)
    assert isinstance(app, AppConfig), type(app)
    return app


def version() -> str:
    try:
        return importlib.metadata.version("specsched")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _setup(cfg: DictConfig) -> AppConfig:
    logging.basicConfig(
        level=load_settings().log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return resolve(cfg)
    except ValueError as e:
        sys.exit(f"specsched: invalid config: {e}")


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
    return log


def _serve(cfg: DictConfig) -> None:
    app = _setup(cfg)
    from specsched.daemon.engine import Engine

    engine = Engine.from_config(to_engine_config(app))
    log = _open_log(app, cfg, engine)
    try:
        Server(engine, app.daemon, log).serve_forever()
    finally:
        if log is not None:
            log.close()


def _generate(cfg: DictConfig) -> None:
    app = _setup(cfg)
    assert isinstance(app, GenerateConfig)
    from specsched.daemon.engine import Engine
    from specsched.daemon.request import Request, SamplingParams
    from specsched.models.tokenizer import IncrementalDetokenizer

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


@dataclass
class StepSummary:
    """What a run's steps decided, in aggregate (``specsched-generate`` prints it)."""

    num_steps: int
    num_decode_steps: int
    num_emitted: int
    num_proposed: int
    num_accepted: int
    num_request_steps: int  # (request, decode step) pairs: the denominator of mean k
    scorer_steps: dict[str, int]
    policy_steps: dict[str, int]
    step_ms: float  # measured, summed
    wall_s: float

    @property
    def mean_k(self) -> float:
        return self.num_proposed / self.num_request_steps if self.num_request_steps else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.num_accepted / self.num_proposed if self.num_proposed else None

    @property
    def tokens_per_s(self) -> float:
        return self.num_emitted / self.wall_s if self.wall_s > 0 else 0.0

    def format(self) -> str:
        def mix(counts: dict[str, int]) -> str:
            return ", ".join(f"{name} {n}" for name, n in sorted(counts.items())) or "-"

        acc = "-" if self.acceptance is None else f"{self.acceptance:.1%}"
        rows = [
            ("steps", f"{self.num_steps} ({self.num_decode_steps} decode), {self.step_ms:.1f} ms measured"),
            ("policy", mix(self.policy_steps)),
            ("mean k", f"{self.mean_k:.2f}"),
            ("scorer mix", mix(self.scorer_steps)),
            ("acceptance", f"{acc} ({self.num_accepted}/{self.num_proposed} drafts)"),
            ("tokens", f"{self.num_emitted} in {self.wall_s:.2f} s = {self.tokens_per_s:.1f} tokens/s"),
        ]
        return "\n".join(f"{label:<11} {value}" for label, value in rows)


def summarize_steps(records: list[StepRecord], wall_s: float) -> StepSummary:
    decode = [r for r in records if r.kind == "decode"]
    return StepSummary(
        num_steps=len(records),
        num_decode_steps=len(decode),
        num_emitted=sum(r.num_emitted for r in records),
        num_proposed=sum(r.num_proposed for r in decode),
        num_accepted=sum(r.num_accepted for r in decode),
        num_request_steps=sum(len(r.requests) for r in decode),
        scorer_steps=dict(Counter(r.scorer for r in decode if r.scorer)),
        policy_steps=dict(Counter(r.policy for r in decode if r.policy)),
        step_ms=sum(r.total_ms for r in records),
        wall_s=wall_s,
    )


def _main(config_name: str, task: Callable[[DictConfig], None]) -> None:
    register_configs()
    hydra.main(config_path=CONFIG_PATH, config_name=config_name, version_base="1.3")(task)()


def serve() -> None:
    """``specsched-serve [overrides]``: start the daemon (``--cfg job`` prints the resolved config)."""
    _main("config", _serve)


def generate() -> None:
    """``specsched-generate prompt="..." [max_tokens=N] [overrides]``."""
    _main("generate", _generate)
