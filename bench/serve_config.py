"""The config of ``bench=serve`` (the ``serve`` section of conf/bench/default.yaml), validated."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from specsched.bench.prompts import PROMPTS

KINDS = ("baseline", "fixed", "policy", "default")


@dataclass
class DaemonRun:
    """One config of the grid: a name and the daemon's hydra overrides. ``kind`` (for the targets):
    baseline = non-speculative (the same-output reference, run first), fixed = a fixed (k, scorer)
    row, default = the default policy with the default scorers, policy = any other. ``reference``
    (rounds mode only): the config whose first-round outputs this one's ``same output`` is checked
    against, in place of the baseline's (e.g. a deterministic-mode row against the deterministic
    non-speculative row, in one interleaved run with the mode off and on). ``env``: more environment
    for this config's daemon, over ``bench.serve.env`` (e.g. ``OMP_NUM_THREADS: 1`` in one row of an
    A/B). An override ``log=none`` keeps this daemon's decision log off under ``bench.serve.log_dir``."""

    name: str
    overrides: list[str] = field(default_factory=list)
    kind: str = "policy"
    reference: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.env = {str(k): str(v) for k, v in (self.env or {}).items()}
        if not self.name.strip():
            raise ValueError("bench.serve.configs: every config needs a non-empty name")
        if self.kind not in KINDS:
            raise ValueError(
                f"bench.serve.configs[{self.name!r}].kind must be one of {KINDS}, got {self.kind!r}"
            )
        bad = [o for o in self.overrides if "=" not in o or o.split("=", 1)[0].startswith("daemon.endpoint")]
        if bad:
            raise ValueError(f"bench.serve.configs[{self.name!r}]: {bad[0]!r} is not a key=value override "
                             "(daemon.endpoint is set by the bench)")  # fmt: skip


@dataclass
class ServeConfig:
    enabled: bool = False
    source: str = "smollm2"  # model.source of every daemon: smollm2 | a .gguf file | an HF folder | a preset
    model_overrides: list[str] = field(default_factory=list)  # more overrides for every daemon
    configs: list[DaemonRun] = field(default_factory=list)
    prompts: str = "chat"  # chat: bench/prompts.py as messages | ids: token-id motifs (no tokenizer)
    num_prompts: int = 8
    prompt_indices: list[int] | None = None  # chat: which of bench/prompts.py (None: the first num_prompts)
    prompt_len: int = 64  # ids only
    prompt_vocab: int = 256  # ids: token ids in [3, prompt_vocab)
    num_requests: int = 32  # per pass and concurrency (at least the concurrency); with duration_s: unused
    # > 0: each (N, pass) is a closed loop (every client sends its next request as soon as one is done;
    # client c of N sends prompts c, c+N, ...; its first request cut to ceil(max_tokens*(c+1)/N) tokens:
    # a staggered start) and tok/s counts the tokens that arrived in a window of duration_s seconds
    # after the ramp (requests still running at its end are drained, outside it); 0: a pass is
    # num_requests requests, wall-clocked
    duration_s: float = 0.0
    # timed passes: the window opens when every client's first (staggered, cut-short) request is done,
    # and not before ramp_s seconds after the first send (0: as soon as they are done)
    ramp_s: float = 0.0
    # > 0 (with duration_s): the passes of each N share one closed loop of passes x duration_s, its
    # requests dealt to them in turn (bench/serve_results.py split_interleaved): both passes see the
    # same host drift and the same prompts; the loop's tok/s in slices of interleave_s seconds is
    # reported beside them. 0: one loop per pass, pass 1 of every N before pass 2
    interleave_s: float = 0.0
    # > 0 (with duration_s): every config's daemon up at once and, per N, this many rounds, each one
    # timed loop per config in a fresh seeded order (bench/serve_rounds.py): every config measured
    # across the same stretch of host time; round r is pass r of the table, or with interleave_s each
    # loop (passes x duration_s) is dealt to the passes, each pooled over the rounds. 0: one daemon at
    # a time
    rounds: int = 0
    # rounds mode: the rounds at each N of ``concurrency`` (same length), instead of ``rounds`` at all;
    # at N = 64 one round's loop differs from the next by 20-60 % on the H200 (2026-12-04), at N = 1-16
    # by 2-15 %, so the high N get more rounds
    rounds_per_n: list[int] | None = None
    # rounds mode: each config served by this many daemon processes, all up at once; round r at the
    # i-th N runs on replica (r + i) mod replicas. A daemon's host speed is set for its whole life
    # (where its threads and memory landed): on an H100 on 2026-12-07 two configs' daemons ran the same
    # step shape 6 % apart, an offset that no number of rounds averages out. Replicas put it in the
    # rounds' spread and in a table of their own (bench/serve_replicas.py). 1: one daemon a config
    replicas: int = 1
    # every daemon's extra overrides in rounds mode: a fixed KV cache (a share of the memory still
    # free at its start would shrink from daemon to daemon)
    round_overrides: list[str] = field(default_factory=lambda: ["cache.num_blocks=4096"])
    pin_cpus: bool = (
        True  # Linux, >= 4 cores: daemons on the first half of the cores, the clients on the rest
    )
    # the load generator's clients per process (bench/serve_load.py): N clients run in ceil(N / this)
    # spawned processes (at most the client cores); 0: all in the bench's own process. One process for
    # 64 clients was the bottleneck on the H200 (2026-12-04: a client's finish -> next send 20-28 ms)
    clients_per_proc: int = 8
    max_tokens: int = 128
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    passes: int = 2
    warmup_requests: int = 1
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0
    warm_start: bool = True  # restart the first config at the end: warm start-up time
    # convert the source's weights (python -m specsched.models.prepare) before the first daemon, timed
    # apart: the first daemon's start-up is then the kernels' cold start, not the one-time conversion
    prepare_weights: bool = True
    log_dir: str | None = None  # decision logs <log_dir>/<config>.sqlite (specsched-replay); None: log=none
    oracle_override: str | None = None  # ids prompts: later daemons get <this>=<oracle.json> (synthetic)
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the daemons
    seed: int = 0

    def __post_init__(self) -> None:
        self.configs = [c if isinstance(c, DaemonRun) else DaemonRun(**c) for c in self.configs]
        self.env = {str(k): str(v) for k, v in self.env.items()}
        names = [c.name for c in self.configs]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"bench.serve.configs: need at least one config, names unique; got {names}")
        if sum(c.kind == "baseline" for c in self.configs) > 1:
            raise ValueError("bench.serve.configs: at most one config of kind baseline")
        for c in self.configs:
            if c.reference is None:
                continue
            target = next((t for t in self.configs if t.name == c.reference), None)
            if target is None or target is c or target.reference is not None:
                raise ValueError(
                    f"bench.serve.configs[{c.name!r}].reference must name another config without a "
                    f"reference of its own; got {c.reference!r} (configs: {names})"
                )
            if not self.rounds:
                raise ValueError(f"bench.serve.configs[{c.name!r}].reference needs rounds mode "
                                 "(bench.serve.rounds > 0)")  # fmt: skip
        if self.prompts not in ("chat", "ids"):
            raise ValueError(f"bench.serve.prompts must be chat or ids, got {self.prompts!r}")
        for key in ("num_prompts", "num_requests", "max_tokens", "passes", "prompt_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"bench.serve.{key} must be >= 1, got {getattr(self, key)}")
        if self.clients_per_proc < 0:
            raise ValueError(f"bench.serve.clients_per_proc must be >= 0 (0: one process), "
                             f"got {self.clients_per_proc}")  # fmt: skip
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(
                f"bench.serve.concurrency must be a non-empty list of ints >= 1, got {self.concurrency}"
            )
        if self.prompt_indices is not None and not all(0 <= i < len(PROMPTS) for i in self.prompt_indices):
            raise ValueError(
                f"bench.serve.prompt_indices must be in [0, {len(PROMPTS)}), got {self.prompt_indices}"
            )
        if self.oracle_override is not None and self.prompts != "ids":
            raise ValueError(
                "bench.serve.oracle_override needs prompts=ids (the oracle is keyed by prompt ids)"
            )
        if self.duration_s < 0:
            raise ValueError(
                f"bench.serve.duration_s must be >= 0 (0: count requests), got {self.duration_s}"
            )
        if self.ramp_s < 0:
            raise ValueError(f"bench.serve.ramp_s must be >= 0, got {self.ramp_s}")
        if self.interleave_s < 0 or (self.interleave_s and not 0 < self.interleave_s <= self.duration_s):
            raise ValueError(
                f"bench.serve.interleave_s must be 0 or in (0, duration_s = {self.duration_s:g}], "
                f"got {self.interleave_s:g}"
            )
        if self.rounds < 0 or (self.rounds and not self.duration_s):
            raise ValueError(f"bench.serve.rounds must be 0 or >= 1 with duration_s > 0, got {self.rounds} "
                             f"(duration_s {self.duration_s:g})")  # fmt: skip
        if self.rounds_per_n is not None and (
            not self.rounds or len(self.rounds_per_n) != len(self.concurrency) or min(self.rounds_per_n) < 1
        ):
            raise ValueError(
                f"bench.serve.rounds_per_n must give every N of concurrency {self.concurrency} >= 1 rounds "
                f"(and rounds > 0: rounds mode), got {self.rounds_per_n}"
            )
        if self.rounds and self.oracle_override is not None:
            raise ValueError("bench.serve.rounds needs oracle_override null: the oracle comes from the "
                             "baseline's outputs, which rounds mode has only after every daemon "
                             "started")  # fmt: skip
        if self.replicas < 1 or (self.replicas > 1 and not self.rounds):
            raise ValueError(f"bench.serve.replicas must be >= 1, and 1 unless rounds mode (rounds > 0); got "
                             f"{self.replicas} with rounds {self.rounds}")  # fmt: skip
        if self.prompt_vocab < 4:
            raise ValueError(f"bench.serve.prompt_vocab must be >= 4, got {self.prompt_vocab}")

    @classmethod
    def from_dictconfig(cls, cfg: DictConfig) -> ServeConfig:
        return cls(**OmegaConf.to_container(cfg, resolve=True))

    def rounds_at(self, n: int) -> int:
        """Rounds mode: the rounds at concurrency ``n``."""
        if self.rounds_per_n is None:
            return self.rounds
        return self.rounds_per_n[self.concurrency.index(n)]

    @property
    def referenced(self) -> set[str]:
        """Names of the configs some other config takes its same-output references from."""
        return {c.reference for c in self.configs if c.reference is not None}

    @property
    def ordered(self) -> list[DaemonRun]:
        """The configs, the baseline first."""
        return sorted(self.configs, key=lambda c: c.kind != "baseline")
