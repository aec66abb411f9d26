"""The hydra config schemas of the console entry points (cli.py), and the one mapping from them onto
the engine's :class:`~specsched.engine.config.EngineConfig`.

Configs live in ``conf/`` (installed as ``specsched.conf``); the dataclass schemas below are registered
in hydra's ConfigStore (:func:`register_configs`), so a mistyped override fails at start with hydra's
own message. :func:`resolve` turns the composed config into these dataclasses (``OmegaConf.to_object``);
no DictConfig goes further.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from specsched.daemon.limits import DaemonConfig
from specsched.daemon.log_config import LogConfig
from specsched.engine.config import (
    CacheConfig,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    NgramConfig,
    SchedulerConfig,
    SpecConfig,
)
from specsched.scorers.registry import default_scorer_names


@dataclass
class ProposerOptions:
    """The ``proposer`` group: which proposer and the engine's cap on k."""

    name: str = "ngram"  # none | ngram | draft | synthetic
    max_k: int = 8
    ngram: NgramConfig = field(default_factory=NgramConfig)
    synthetic_acceptance: float = 0.7  # proposer=synthetic only (benchmarks)
    synthetic_oracle: str | None = None  # proposer=synthetic: oracle JSON path (bench/serve.py writes it)

    def __post_init__(self) -> None:
        if self.max_k < 0:
            raise ValueError(f"proposer.max_k must be >= 0, got {self.max_k}")
        if not 0.0 <= self.synthetic_acceptance <= 1.0:
            raise ValueError(
                f"proposer.synthetic_acceptance must be in [0, 1], got {self.synthetic_acceptance}"
            )
        if self.synthetic_oracle is not None and not self.synthetic_oracle.strip():
            raise ValueError(
                f"proposer.synthetic_oracle must be a file path or null, got {self.synthetic_oracle!r}"
            )


@dataclass
class ScorerOptions:
    """The ``scorer`` group: the scorers built at start (the policy picks among them each step)."""

    names: list[str] = field(default_factory=lambda: ["batch_expansion", "mqa"])
    # the cost models add each captured graph's residual to the graph scorers' predictions
    # (policies/bucket_bias.py); false: the linear model alone
    graph_residual: bool = True

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


def machine_device_type() -> str:
    """``cuda`` when this machine has a CUDA device (what ``model.device=auto`` picks), else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def register_configs() -> None:
    """Register the schemas (group ``schema``, selected by conf/config.yaml and conf/generate.yaml)
    and the ``scorer=auto`` option: this machine's default scorers, so ``--cfg job`` lists them."""
    cs = ConfigStore.instance()
    cs.store(group="schema", name="serve", node=AppConfig)
    cs.store(group="schema", name="generate", node=GenerateConfig)
    cs.store(group="scorer", name="auto", node={"names": default_scorer_names(machine_device_type())})


def to_engine_config(app: AppConfig) -> EngineConfig:
    """The one mapping from the app config onto the engine's."""
    spec = SpecConfig(
        proposer=app.proposer.name,
        scorers=list(app.scorer.names),
        max_k=app.proposer.max_k,
        ngram=app.proposer.ngram,
        draft=app.draft,
        synthetic_acceptance=app.proposer.synthetic_acceptance,
        synthetic_oracle=app.proposer.synthetic_oracle,
        graph_residual=app.scorer.graph_residual,
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
