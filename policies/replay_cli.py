"""``specsched-replay``: evaluate policies on a recorded run (hydra app; docs/policies.md, "Offline replay").

    specsched-replay db=run.sqlite                          # every built-in policy, defaults
    specsched-replay db=run.sqlite policy=goodput policy.scorer_margin=0.1
    specsched-replay db=run.sqlite policy=[fixed,goodput] policy.fixed.k=2 plot=true out=charts run_id=3

``policy.<option>=<value>`` goes to every named policy, ``policy.<name>.<option>=<value>`` to that
one (both rewritten to ``++policy_options.<...>`` before hydra parses them, since ``policy`` itself
holds the names); ``--plot`` means ``plot=true``; a policy name with a dot is an import path
(``_target_``). The schema is :class:`ReplayConfig`.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from specsched.engine.log_schema import LogFormatError
from specsched.policies.registry import build_policy
from specsched.policies.replay import PolicyResult, ReplayOptions, ReplayReport, default_policies, replay
from specsched.policies.replay_log import ReplayError, load_run

CONFIG_NAME = "specsched_replay"
PROG = "specsched-replay"
_HYDRA = {"run": {"dir": "."}, "output_subdir": None, "job": {"chdir": False}}  # no outputs/ folder


@dataclass
class ReplayConfig:
    """``specsched-replay``'s config."""

    defaults: list[Any] = field(
        default_factory=lambda: [
            "_self_",
            {"override hydra/job_logging": "none"},
            {"override hydra/hydra_logging": "none"},
        ]
    )
    hydra: Any = field(default_factory=lambda: dict(_HYDRA))
    db: str = MISSING  # the decision log (SQLite)
    run_id: int | None = None  # None: the latest run in the log
    policy: Any = None  # a name, a list of names, or None: every built-in policy
    # set by `policy.<option>=` (every named policy) and `policy.<name>.<option>=` (that one)
    policy_options: dict[str, Any] = field(default_factory=dict)
    plot: bool = False  # write the PNG charts to `out`
    out: str = "replay"  # folder for the charts
    seed: int = 0  # of the imputed match bits
    scorers: list[str] | None = None  # scorers the policies may pick; None: the run's
    forgetting: float = 1.0  # of the refitted cost model (1: all steps weigh the same)
    # a bench=serve log (N clients at a time, N = 1, 4, 16, 64 in turn): replay each concurrency's
    # segments apart, max_num_seqs = N (policies/replay_segments.py)
    by_concurrency: bool = False

    def __post_init__(self) -> None:
        if self.run_id is not None and self.run_id < 1:
            raise ValueError(f"run_id must be >= 1 (runs are numbered from 1), got {self.run_id}")
        names = self.policy_names
        if not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"policy must be a name or a list of names, got {self.policy!r}")
        if self.policy_options and not names:
            raise ValueError(
                f"policy options {sorted(self.policy_options)} need the policy they are for: "
                f"policy=<name> policy.<option>=<value>"
            )

    @property
    def policy_names(self) -> list:
        if self.policy is None:
            return []
        return list(self.policy) if isinstance(self.policy, (list, tuple)) else [self.policy]

    def policy_configs(self) -> list[dict] | None:
        """The policy configs for ``build_policy`` (None: every built-in with its defaults)."""
        names = self.policy_names
        if not names:
            return None
        shared = {k: v for k, v in self.policy_options.items() if k not in names}
        out = []
        for n in names:
            own = self.policy_options.get(n, {})
            if not isinstance(own, dict):
                raise ValueError(f"policy.{n} must hold options (policy.{n}.<option>=<value>), got {own!r}")
            out.append({("_target_" if "." in n else "name"): n, **shared, **own})
        return out


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "0%"


def register_configs() -> None:
    ConfigStore.instance().store(name=CONFIG_NAME, node=ReplayConfig)


_POLICY_OPTION = re.compile(r"^\+{0,2}policy\.([A-Za-z_][\w.]*)=(.*)$", re.S)


def rewrite_args(args: list[str]) -> list[str]:
    """``policy.x=v`` -> ``++policy_options.x=v``; ``--plot`` -> ``plot=true``; ``policy=a,b`` ->
    ``policy=[a,b]`` (hydra would read the comma as a sweep)."""
    out = []
    for a in args:
        m = _POLICY_OPTION.match(a)
        if m:
            a = f"++policy_options.{m.group(1)}={m.group(2)}"
        elif a == "--plot":
            a = "plot=true"
        elif a.startswith("policy=") and "," in a and not a.startswith("policy=["):
            a = f"policy=[{a[len('policy=') :]}]"
        out.append(a)
    return out


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _mix(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    return (
        ", ".join(f"{n} {100 * c / total:.0f}%" for n, c in sorted(counts.items(), key=lambda x: -x[1]))
        or "-"
    )


COLUMNS = (
    "policy", "source", "steps", "tokens", "tok/step", "mean k", "scorer mix",
    "pred ms", "pred tok/s", "meas ms", "meas tok/s", "imputed",
)  # fmt: skip


def _cells(r: PolicyResult) -> list[str]:
    if r.error is not None:
        return [r.label, r.source, f"error: {r.error}"]
    share = None if r.imputed_share is None else 100 * r.imputed_share
    return [
        r.label, r.source, str(r.num_steps), str(r.num_tokens), f"{r.tokens_per_step:.2f}", f"{r.mean_k:.2f}",
        _mix(r.scorer_steps), f"{r.predicted_ms:.1f}", f"{r.tokens_per_s:.1f}", _fmt(r.measured_ms),
        _fmt(r.measured_tokens_per_s), "-" if share is None else f"{share:.1f}%",
    ]  # fmt: skip


def format_table(rows: list[PolicyResult]) -> str:
    cells = [list(COLUMNS)] + [_cells(r) for r in rows]
    full = [c for c in cells if len(c) == len(COLUMNS)]
    widths = [max(len(c[i]) for c in full) for i in range(len(COLUMNS))]
    lines = []
    for c in cells:
        if len(c) < len(COLUMNS):  # an error row: its message after the first two columns
            lines.append(f"{c[0]:<{widths[0]}}  {c[1]:<{widths[1]}}  {c[2]}")
            continue
        left = [f"{v:<{w}}" for v, w in zip(c[:2], widths[:2], strict=True)]
        mid = [f"{v:>{w}}" for v, w in zip(c[2:6], widths[2:6], strict=True)]
        right = [f"{v:>{w}}" for v, w in zip(c[7:], widths[7:], strict=True)]
        lines.append("  ".join([*left, *mid, f"{c[6]:<{widths[6]}}", *right]).rstrip())
    return "\n".join(lines)


def format_report(report: ReplayReport) -> str:
    run, st, bits = report.run, report.run.settings, report.bits
    decode, prefill = run.decode_steps, run.prefill_steps
    head = [
        f"run {run.run_id} of {run.path}: model {run.model} on {run.device}, specsched {run.version}",
        f"proposer {st.proposer}, max_k {st.max_k}, max_num_seqs {st.max_num_seqs}, "
        f"scorers {', '.join(st.scorers)}",
        f"{len(decode)} decode + {len(prefill)} prefill steps; the prefills' measured "
        f"{sum(s.cost_ms for s in prefill):.1f} ms are in every row; {len(run.requests)} requests, "
        f"{sum(r.output_len for r in run.requests)} output tokens",
    ]
    notes = [
        f"match bits: {bits.num_draftable} draftable positions, "
        f"{100 * (1 - bits.imputed_share):.1f}% recorded, {100 * bits.imputed_share:.1f}% imputed "
        f"({_share(bits.num_pooled, bits.num_draftable)} from other lives of the same prompt, the rest "
        f"seeded Bernoulli draws, seed {bits.seed}, run mean {bits.run_mean:.2f})"
    ]
    recorded = next(r for r in report.rows if r.source == "recorded")
    if decode:
        ks = [q.k for s in decode for q in s.requests]
        batches = [len(s.requests) for s in decode]
        err = sum(abs(t.predicted_ms - (t.measured_ms or 0.0)) for t in recorded.trace) / len(recorded.trace)
        mean_ms = sum(s.cost_ms for s in decode) / len(decode)
        fit = ", ".join(f"{n} {c}" for n, c in sorted(report.fit_steps.items()))
        notes.append(
            f"cost model: refit on {len(decode)} decode steps ({fit}; batch {min(batches)}-{max(batches)}, "
            f"k {min(ks)}-{max(ks)}); on them mean |predicted - measured| {err:.2f} ms/step "
            f"({100 * err / mean_ms if mean_ms else 0:.1f}% of the mean step)"
        )
    churn = report.costs.churn
    if churn is not None and churn.counts:
        cells = ", ".join(f"{g} {c} {ms:+.2f} ({n})" for (g, c), (n, ms) in churn.table().items())
        notes.append(f"churn residual, ms per step by batch group and class (steps): {cells}")
    unfitted = sorted(set(st.scorers) - set(report.fit_steps))
    if unfitted:
        notes.append(f"cost model: no recorded steps of {', '.join(unfitted)}: seed coefficients only")
    if st.defaulted:
        notes.append(f"not in the run's config, defaults used: {', '.join(st.defaulted)}")
    if run.num_conflicts:
        notes.append(
            f"{run.num_conflicts} match bits disagree between recorded steps (sampled or n-gram drafts)"
        )
    unfinished = sum(not r.is_finished for r in run.requests)
    if unfinished:
        notes.append(
            f"{unfinished} requests have no `requests` row (unfinished): replayed to their logged length"
        )
    return "\n".join([*head, "", format_table(report.rows), "", *(f"- {n}" for n in notes)])


def _run(cfg: DictConfig) -> None:
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (e.g. {PROG} db=run.sqlite)")
        app = OmegaConf.to_object(cfg)
        assert isinstance(app, ReplayConfig), type(app)
        configs = app.policy_configs()
        for c in configs or []:
            build_policy(c)  # an unknown name or option fails here, before any work
        opts = ReplayOptions(seed=app.seed, scorers=app.scorers, forgetting=app.forgetting)
    except ValueError as e:
        sys.exit(f"{PROG}: invalid config: {e}")
    if app.by_concurrency:
        from specsched.policies.replay_segments import format_levels, replay_by_level

        try:
            run = load_run(app.db, app.run_id)
            recorded = [run.settings.policy] if run.settings.policy else []
            print(format_levels(replay_by_level(run, recorded + list(configs or default_policies()), opts)))
        except (LogFormatError, ReplayError) as e:
            sys.exit(f"{PROG}: {e}")
        return
    try:
        report = replay(load_run(app.db, app.run_id), configs, opts)
    except (LogFormatError, ReplayError) as e:
        sys.exit(f"{PROG}: {e}")
    print(format_report(report))
    if app.plot:
        from specsched.policies.replay_plots import write_plots

        for path in write_plots(report, app.out):
            print(f"wrote {path}")


def main() -> None:
    """``specsched-replay db=run.sqlite [policy=...] [policy.x=...] [plot=true] [out=dir] [run_id=N]``."""
    register_configs()
    sys.argv = [sys.argv[0], *rewrite_args(sys.argv[1:])]
    hydra.main(config_path=None, config_name=CONFIG_NAME, version_base="1.3")(_run)()


if __name__ == "__main__":
    main()
