"""End-to-end tokens/s and per-token latency through :class:`Engine`: non-speculative, the fixed
(k, scorer) grid and each policy.

Two suites share one runner:
- ``synthetic``: the ``llama2-7b`` preset (random weights) with the ``llama-68m`` draft, whose
  drafts are replaced by the target's own greedy continuation with probability a (the labelled
  synthetic-acceptance proposer; the real draft still runs so its cost is paid). The continuation
  (the oracle) is the non-speculative run of the same prompts.
- ``real``: a real model (SmolLM2-135M by default) with its self-draft (first L layers) and n-gram
  on real prompts.

Each configuration gets a fresh engine (scheduler, cost models, acceptance) over the shared model,
caches and captured graphs, a short warm-up generate (the goodput policy's cost models learn there
too), then one timed ``generate`` of all prompts bracketed by ``torch.cuda.synchronize``.
Per-token latency = wall time / output tokens per request (every request starts together).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple

import torch

from specsched.bench.common import EngineSpec, make_engine, sync
from specsched.daemon.log import LogWriter
from specsched.daemon.log_config import LogConfig
from specsched.engine.config import SchedulerConfig
from specsched.engine.records import StepRecord
from specsched.engine.request import SamplingParams
from specsched.policies.base import Policy
from specsched.policies.fixed import FixedConfig, FixedPolicy
from specsched.proposers.base import Proposer
from specsched.scorers.graph import graph_runners_of

logger = logging.getLogger(__name__)


@dataclass
class E2ERow:
    suite: str  # synthetic | real
    model: str
    proposer: str
    acceptance: float | None  # synthetic acceptance (None: real proposer)
    batch: int
    config: str  # "non-speculative", "fixed k=3 mqa_graph", "policy goodput"
    tokens_per_s: float = float("nan")
    ms_per_token: float = float("nan")
    num_tokens: int = 0
    measured_acceptance: float | None = None  # accepted / proposed drafts
    mean_k: float | None = None  # drafts proposed per request-step
    scorer_steps: dict | None = None
    speedup: float | None = None  # vs the non-speculative row of the same batch
    graph_fallbacks: int = 0
    step_ms: dict | None = None  # mean ms per decode step: propose, score, verify, total (host wall)
    same_output: float | None = None  # share of requests whose output equals the non-speculative one
    note: str = ""
    error: str = ""


@dataclass
class RunConfig:
    """One timed configuration: its label, the policy, the proposer set and the default proposer,
    and the scheduler options its engine runs with beside the cell's (a policy variant's
    ``scheduler`` entry: :func:`policy_configs`)."""

    label: str
    make_policy: Callable[[], Policy]
    proposers: dict[str, Proposer]
    proposer: str
    scheduler: dict = field(default_factory=dict)  # SchedulerConfig overrides for this config alone
    draft_loop: bool = False  # its draft proposes on the draft loop graphs (models/draft_loop.py)


class PolicyEntry(NamedTuple):
    label: str
    make: Callable[[], Policy]
    scheduler: dict  # SchedulerConfig overrides of this config's engine ({} for most)
    draft_loop: bool = False  # a policy_args entry's ``draft_loop: true``


def use_draft_loop(run: RunConfig) -> None:
    """Before ``run``'s engine runs: its draft proposer (a synthetic proposer's paid draft too) takes
    the draft loop graphs if the config asks for them and the cell captured them, else the
    step-by-step path (the proposers are shared by a cell's configs)."""
    for prop in run.proposers.values():
        draft = getattr(prop, "draft", None) or prop
        if hasattr(draft, "is_loop_used"):
            draft.is_loop_used = run.draft_loop


def wants_draft_loop(cfg, scorers: list[str]) -> bool:
    """Whether any config of a suite's ``cfg`` asks for the draft loop graphs (the cell captures them)."""
    return any(e.draft_loop for e in policy_configs(cfg, scorers))


def scheduler_overrides(entry: str, options: dict) -> dict:
    """A ``policy_args`` entry's ``scheduler`` mapping, checked against SchedulerConfig's fields and
    its own checks (a typo or a bad value would otherwise surface deep in a timed window)."""
    known = {f.name for f in fields(SchedulerConfig)}
    bad = sorted(set(options) - known)
    if bad:
        raise ValueError(
            f"policy_args.{entry}.scheduler: unknown scheduler option(s) {', '.join(bad)}; "
            f"known: {', '.join(sorted(known))}"
        )
    try:
        SchedulerConfig(**options)
    except ValueError as e:
        raise ValueError(f"policy_args.{entry}.scheduler: {e}") from None
    return dict(options)


def policy_configs(cfg, scorers: list[str]) -> list[PolicyEntry]:
    """A :class:`PolicyEntry` for each config of the fixed (k, scorer) grid and each named policy of ``cfg``
    (``policies``: registry names, or ``name@tag`` for a variant whose options are ``policy_args``'
    entry ``name@tag``; labels ``policy name (option=value, ...)``). An entry's ``scheduler`` mapping
    is no policy option: it sets SchedulerConfig options of that config's engine alone (e.g.
    ``goodput@no_ahead: {scheduler: {plan_ahead: "off"}}``, labelled ``scheduler.plan_ahead=off``), nor
    is ``draft_loop: true``: that config's draft proposes on the draft loop graphs (labelled
    ``draft.loop_graphs=true``; the cell captures them when a config asks)."""
    out: list[PolicyEntry] = []
    for k in cfg.fixed_k:
        for s in cfg.fixed_scorers:
            if s in scorers:
                out.append(
                    PolicyEntry(
                        f"fixed k={k} {s}", lambda k=k, s=s: FixedPolicy(FixedConfig(k=k, scorer=s)), {}
                    )
                )
    args = dict(cfg.get("policy_args") or {})
    for entry in cfg.policies:
        # "name@tag": a variant of policy name with its own policy_args entry (an A/B within a cell)
        name = entry.partition("@")[0]
        options = dict(args.get(entry) or {})
        scheduler = scheduler_overrides(entry, dict(options.pop("scheduler", None) or {}))
        draft_loop = options.pop("draft_loop", False)
        if not isinstance(draft_loop, bool):
            raise ValueError(f"policy_args.{entry}.draft_loop must be true or false, got {draft_loop!r}")
        spec = {"name": name, **options}
        shown = (
            [f"{k}={v}" for k, v in options.items()]
            + [f"scheduler.{k}={v}" for k, v in scheduler.items()]
            + ["draft.loop_graphs=true"] * draft_loop
        )
        label = f"policy {name}" + (f" ({', '.join(shown)})" if shown else "")

        def build(spec=spec) -> Policy:
            from specsched.policies.registry import build_policy

            return build_policy(spec)

        out.append(PolicyEntry(label, build, scheduler, draft_loop))
    return out


def timed_generate(
    spec: EngineSpec,
    run: RunConfig,
    prompts: list[list[int]],
    batch: int,
    max_new_tokens: int,
    warmup_tokens: int,
    log_path: str | None = None,
    log_run: dict | None = None,
) -> tuple[dict, list[list[int]]]:
    """Warm up, then time the prompts in groups of ``batch`` (each group one ``generate``); returns
    metrics and the outputs. With ``log_path``, every step (warm-up included) also goes to that
    SQLite decision log as one run (``log_run``: its config row), for specsched-replay and SQL."""
    use_draft_loop(run)
    engine = make_engine(spec, run.proposers, run.proposer, run.make_policy(), run.scheduler)
    device = spec.model.lm_head.weight.device
    log = open_run_log(log_path, log_run or {"config": run.label}, spec.name, str(device))
    try:
        return _timed(engine, log, spec, prompts, batch, max_new_tokens, warmup_tokens, device)
    finally:
        if log is not None:
            log.close()


def open_run_log(path: str | None, config: dict, model: str, device: str) -> LogWriter | None:
    if not path:
        return None
    from specsched.daemon.cli import version

    log = LogWriter(LogConfig(path=path))
    log.start_run(config, model=model, device=device, version=version())
    return log


def _timed(
    engine,
    log: LogWriter | None,
    spec: EngineSpec,
    prompts: list[list[int]],
    batch: int,
    max_new_tokens: int,
    warmup_tokens: int,
    device: torch.device,
) -> tuple[dict, list[list[int]]]:
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    if log is not None:
        engine.on_step = log.write_step
    if warmup_tokens:  # every group's prefill shape too: a Triton variant first met while timing
        for i, group in enumerate(groups):  # compiles inside the timed window (~0.5 s each)
            n = warmup_tokens if i == 0 else min(4, warmup_tokens)
            engine.generate(group, SamplingParams(max_tokens=n, ignore_eos=True))
    runners = graph_runners_of(spec.scorers)
    fallbacks0 = sum(r.num_eager_fallbacks for r in runners)
    steps = Counter()  # decode steps per scorer
    totals = Counter()  # request-steps, proposed, accepted over decode steps
    phase_ms = Counter()  # summed over decode steps

    def on_step(rec: StepRecord) -> None:
        if log is not None:
            log.write_step(rec)
        if rec.kind == "decode":
            steps[rec.scorer] += 1
            totals.update(request_steps=rec.batch_size, proposed=rec.num_proposed, accepted=rec.num_accepted)
            phase_ms.update(
                propose=rec.propose_ms, score=rec.score_ms, verify=rec.verify_ms, total=rec.total_ms
            )

    engine.on_step = on_step
    params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
    outputs: list[list[int]] = []
    wall = per_request_tokens = 0.0
    for group in groups:
        sync(device)
        t0 = time.perf_counter()
        out = engine.generate(group, params)
        sync(device)
        wall += time.perf_counter() - t0
        per_request_tokens += sum(map(len, out)) / len(group)
        outputs += out
    num_tokens = sum(map(len, outputs))
    metrics = dict(
        tokens_per_s=num_tokens / wall,
        ms_per_token=wall * 1e3 / per_request_tokens,
        num_tokens=num_tokens,
        measured_acceptance=totals["accepted"] / totals["proposed"] if totals["proposed"] else None,
        mean_k=totals["proposed"] / totals["request_steps"] if totals["request_steps"] else None,
        scorer_steps=dict(steps),
        graph_fallbacks=sum(r.num_eager_fallbacks for r in runners) - fallbacks0,
        step_ms={name: ms / max(sum(steps.values()), 1) for name, ms in phase_ms.items()},
    )
    return metrics, outputs


def run_grid(
    suite: str,
    spec: EngineSpec,
    batch: int,
    prompts: list[list[int]],
    runs: list[RunConfig],
    cfg,
    acceptance: float | None = None,
    proposer_label: str = "",
    baseline: E2ERow | None = None,
    reference: list[list[int]] | None = None,
) -> list[E2ERow]:
    """Time each run; a failing run becomes an error row and the grid goes on. With ``reference``
    (the non-speculative outputs), each row records the share of requests with the same output:
    greedy speculation is lossless, so anything below 1 is bf16 rounding in another row layout
    flipping a near-tie (see docs/benchmarks.md)."""
    rows = []
    for run in runs:
        row = E2ERow(suite, spec.name, proposer_label or run.proposer, acceptance, batch, run.label)
        try:
            metrics, outputs = timed_generate(
                spec, run, prompts, batch, cfg.max_new_tokens, cfg.warmup_tokens,
                cfg.get("log_path"), run_identity(suite, spec, batch, row.proposer, acceptance, run.label),
            )  # fmt: skip
        except Exception as e:
            logger.exception("e2e %s %s batch %d failed", suite, run.label, batch)
            row.error = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            continue
        for key, value in metrics.items():
            setattr(row, key, value)
        if reference is not None:
            row.same_output = sum(o == r for o, r in zip(outputs, reference, strict=True)) / len(reference)
        if baseline is not None and baseline.tokens_per_s == baseline.tokens_per_s:
            row.speedup = row.tokens_per_s / baseline.tokens_per_s
        logger.info("e2e %s %s a=%s batch %d %s: %.1f tok/s", suite, row.proposer, acceptance, batch,
                    run.label, row.tokens_per_s)  # fmt: skip
        rows.append(row)
    return rows


def baseline_run(
    suite: str, spec: EngineSpec, batch: int, prompts: list[list[int]], cfg, none_proposer: Proposer
) -> tuple[E2ERow, list[list[int]]]:
    """The non-speculative row (k = 0, plain decode on the decode graphs) and its outputs (the oracle)."""
    scorer = "batch_expansion" if "batch_expansion" in spec.scorers else next(iter(spec.scorers))
    run = RunConfig("non-speculative", lambda: FixedPolicy(FixedConfig(k=0, scorer=scorer)),
                    {"none": none_proposer}, "none")  # fmt: skip
    row = E2ERow(suite, spec.name, "none", None, batch, run.label)
    metrics, outputs = timed_generate(
        spec, run, prompts, batch, cfg.max_new_tokens, cfg.warmup_tokens,
        cfg.get("log_path"), run_identity(suite, spec, batch, "none", None, run.label),
    )  # fmt: skip
    for key, value in metrics.items():
        setattr(row, key, value)
    row.speedup = 1.0
    return row, outputs


def run_identity(suite: str, spec: EngineSpec, batch: int, proposer: str, acceptance, config: str) -> dict:
    """The ``runs.config`` row of one benchmark run in the decision log."""
    return {"bench": suite, "model": spec.name, "batch": batch, "proposer": proposer,
            "acceptance": acceptance, "config": config}  # fmt: skip


def rows_as_dicts(rows: list[E2ERow]) -> list[dict]:
    return [asdict(r) for r in rows]


def is_cuda(spec: EngineSpec) -> bool:
    return spec.model.lm_head.weight.device.type == "cuda"


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
