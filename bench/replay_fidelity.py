"""Replay fidelity (issue 13): does ``specsched-replay`` on one decision log predict the tokens/s that
other policies measured live?

``python -m specsched.bench.replay_fidelity --replayed goodput.sqlite --live a.sqlite [--live b.sqlite
...] [--out table.md] [--cost-error]``

For each live log: its recorded policy config (the ``policy`` node of its ``runs.config``, read by
:func:`specsched.policies.replay_log.load_run`) is replayed on the ``--replayed`` log with the replay
machinery of :mod:`specsched.policies.replay` (its match bits, completed once; its cost model, refitted
on all its decode steps, for a policy that does not decide ahead without the recorded policy's decide
spill: :func:`~specsched.policies.replay_costs.costs_for`), and the predicted tokens/s is set against the
live log's measured tokens/s.

**tokens/s, one definition on both sides** (:class:`~specsched.policies.replay.PolicyResult`):
output tokens (each request's prefill token included) / (decode ms + prefill ms). Live, the decode ms
are the recorded steps' measured ``total_ms`` (``measured_tokens_per_s``); predicted, the refitted
cost model's ms for each simulated step (``tokens_per_s``). The prefill ms are each log's own
measured prefill steps on both sides. Idle time between steps (IO, clients) counts on neither side,
so these rates are above a pass's wall-clock tok/s. ``decode tok/s`` leaves the prefills out:
decode-emitted tokens / decode ms.

**Passes.** A serving log mixes concurrencies: ``bench=serve`` drives a daemon with N closed-loop
clients per pass. Replaying the whole log with ``scheduler.max_num_seqs`` (64) would batch requests
of an N = 1 pass 64 at a time, so the log is cut into passes (bench/replay_passes.py,
:func:`split_passes`: busy periods of the daemon, from the ``requests`` rows' arrival and finish
times, merged while they share a client),
and each pass is replayed on its own with ``max_num_seqs`` = its number of clients, closed loop (a
client's next request joins when its last one finished) and drained between the pass's busy periods
as live. ``--client-gaps`` also delays each request by its client's recorded round trip (finish to
next arrival; on the H200 it grew from 2 ms at N = 1 to a median of 20-28 ms at N = 64: the load
generator, one asyncio process, falls behind there). One policy object runs through the passes
in order, as live; each pass starts a fresh acceptance estimator (the replay's). The table pools the
passes of each N (sums of tokens and of ms); ``all`` pools every pass. A log without clients
(engine runs) is one pass at the run's ``max_num_seqs``.

The ``self-replay`` columns replay each live log under its own policy on its own bits and cost
model: the replay's own error, without the move to another log's text and machine state.
``--attribute-overhead`` adds a column for attribution, not prediction: the replay on the replayed
log with the host-overhead component (``("overhead",)``: step total minus propose, score and verify)
taken from the live log's refit, i.e. how much of the error is host time that differs between the
two daemons (the policy's own ``decide`` among it). The last column is the share of the predicted
decode steps whose (scorer, batch group) the replayed log ran fewer than ``THIN_STEPS`` times
(:func:`coverage`): those are priced by extrapolation or from the device's priors, not from data.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from specsched.bench.cost_error_table import group_of
from specsched.bench.markdown import emit, fmt, log_name, table
from specsched.bench.replay_passes import (
    PassPart,
    RequestTimes,
    request_times,
    split_passes,
    sub_run,
    think_times,
)
from specsched.policies.cost_model import CostModels
from specsched.policies.registry import build_policy
from specsched.policies.replay import PolicyResult, policy_label, recorded_result, simulate
from specsched.policies.replay_bits import MatchBits, complete_bits
from specsched.policies.replay_costs import costs_for, decide_spill_ms, refit_costs
from specsched.policies.replay_log import RecordedRun, RunSettings, load_run
from specsched.policies.replay_runs import RunRules

__all__ = ["RequestTimes", "split_passes", "think_times", "load_log", "live_rates", "predicted_rates",
           "coverage", "engine_options", "fidelity_rows", "main"]  # fmt: skip


@dataclass
class LoadedLog:
    run: RecordedRun
    bits: MatchBits
    costs: CostModels
    passes: list[PassPart]
    # refitted without the recorded policy's decide spill (policies/replay.py: decide_spill_ms), for
    # policies that do not decide ahead; None when the log has no decide ahead
    costs_without_spill: CostModels | None = None


def load_log(
    path: str, run_id: int | None = None, seed: int = 0, bucket_bias: bool = True, decide_spill: bool = True
) -> LoadedLog:
    """A log with its bits, refitted cost model and passes (see the module docstring); without
    ``decide_spill`` every policy is replayed on the recorded costs (the spill left in)."""
    run = load_run(path, run_id)
    costs = refit_costs(run, count_between=False, bucket_bias=bucket_bias)  # idle time: neither side
    static = None
    if decide_spill and decide_spill_ms(run.decode_steps):
        static = refit_costs(run, count_between=False, bucket_bias=bucket_bias, without_decide_spill=True)
    bits = complete_bits(run, seed)
    times = request_times(path, run.run_id)
    passes = split_passes(times, run.settings.max_num_seqs)
    return LoadedLog(run, bits, costs, [sub_run(run, bits, p, times) for p in passes], static)


@dataclass
class Rate:
    """Tokens and ms summed over passes (``ms`` includes the prefills, ``prefill_ms`` alone)."""

    tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0  # decode steps
    ms: float = 0.0
    prefill_ms: float = 0.0
    num_thin: int = 0  # predicted decode steps priced from fewer than THIN_STEPS logged ones (coverage)

    def add(self, res: PolicyResult, run: RecordedRun, measured: bool) -> None:
        self.tokens += res.num_tokens
        self.decode_tokens += res.num_decode_tokens
        self.steps += res.num_steps
        self.ms += res.measured_ms if measured else res.predicted_ms
        prefill = sum(s.total_ms for s in run.prefill_steps)
        if not measured and run.requests:  # a windowed replay ran some: their share (``simulate``)
            prefill *= res.num_admitted / len(run.requests)
        self.prefill_ms += prefill

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.ms * 1e3 if self.ms > 0 else None

    @property
    def thin_share(self) -> float | None:
        return self.num_thin / self.steps if self.steps else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        ms = self.ms - self.prefill_ms
        return self.decode_tokens / ms * 1e3 if ms > 0 else None


def live_rates(log: LoadedLog) -> dict[int, Rate]:
    """Measured rates per concurrency (0: every pass)."""
    out: dict[int, Rate] = {}
    for x in log.passes:
        res = recorded_result(x.run, log.costs)
        for n in (x.p.concurrency, 0):
            out.setdefault(n, Rate()).add(res, x.run, measured=True)
    return out


THIN_STEPS = 20  # a (scorer, batch group) with fewer logged decode steps prices from its prior


def coverage(run: RecordedRun) -> dict[tuple[str, tuple[int, int], bool], int]:
    """The log's decode steps per (scorer, batch group of cost_error_table, whether the step drafted):
    what its refitted cost models have seen. A replayed step of a (scorer, group) with few is priced by
    extrapolation or by the device's seed coefficients (on 2026-12-04 those are llama2-7b's: a SmolLM2
    log that never ran batch expansion above batch 4 priced it 3-9x too slow at 16-64), and a drafting
    step on a log that drafted little in that (scorer, group) (a non-speculative log) is priced with
    proposal and verification costs the log never measured."""
    counts: dict[tuple[str, tuple[int, int], bool], int] = {}
    for s in run.decode_steps:
        key = (s.scorer, group_of(s.batch_size), any(r.k for r in s.requests))
        counts[key] = counts.get(key, 0) + 1
    return counts


def predicted_rates(
    log: LoadedLog,
    policy: dict,
    client_gaps: bool = False,
    windowed: bool = True,
    engine: RunSettings | None = None,
) -> dict[int, Rate]:
    """Rates per concurrency (0: every pass) of ``policy`` replayed on ``log``, pass by pass: with
    clients, closed loop (each client's requests one at a time), the batch drained between the
    pass's busy periods; ``client_gaps``: each request joins its client's recorded round trip after
    the last one finished (:func:`sub_run`); ``windowed``: the clients send for as long as the live
    ones did in each busy period, going round their requests again (``simulate``'s ``window_ms``),
    each after its recorded round trip (as ``client_gaps``: the live batch ran short while a client
    was between requests, 27 % of k = 8's steps at N = 4 on the H200 on 2026-12-06).
    Each rate counts its steps priced from thin data (:func:`coverage`). ``engine``: the settings of
    the log whose policy this is (another daemon's): its runs of plain steps, and its proposer where
    that is ``none`` (a non-speculative config on a drafting log), replace ``log``'s
    (:func:`engine_options`)."""
    label, instance = policy_label(policy), build_policy(policy)
    proposer, runs = engine_options(engine)
    seen = coverage(log.run)
    out: dict[int, Rate] = {}
    for x in log.passes:
        clients = {r.client for r in x.run.requests}
        closed = None not in clients  # each client's requests one at a time, after its round trip
        costs = costs_for(instance, log.costs, log.costs_without_spill)
        res = simulate(x.run, x.bits, instance, costs, label, closed_loop=closed, segments=x.segments,
                       think_ms=x.think_ms if closed and (client_gaps or windowed) else None,
                       window_ms=x.window_ms if closed and windowed else None, proposer=proposer,
                       runs=runs)  # fmt: skip
        thin = sum(
            seen.get((t.scorer, group_of(t.batch_size), t.mean_k > 0), 0) < THIN_STEPS for t in res.trace
        )
        for n in (x.p.concurrency, 0):
            rate = out.setdefault(n, Rate())
            rate.add(res, x.run, measured=False)
            rate.num_thin += thin
    return out


def engine_options(engine: RunSettings | None) -> tuple[str | None, RunRules | None]:
    """(proposer, runs) of another log's settings to replay its policy with: its runs of plain steps
    (scheduler.decode_steps / plain_decode_steps: how it served, e.g. non-speculative's runs alone),
    and its proposer only where that is ``none`` (another proposer would need its own match bits).
    (None, None) without settings: the replayed log's own."""
    if engine is None:
        return None, None
    return ("none" if engine.proposer == "none" else None), engine.runs


def with_overhead(log: LoadedLog, other: LoadedLog) -> LoadedLog:
    """``log`` with its cost model's host-overhead component replaced by ``other``'s (a copy), and its
    churn residual (host time too: a finished request's reply and log row) by ``other``'s."""
    costs = copy.deepcopy(log.costs)
    costs.models[("overhead",)] = copy.deepcopy(other.costs.model("overhead"))
    costs.churn = copy.deepcopy(other.costs.churn)
    return dataclasses.replace(log, costs=costs, costs_without_spill=None)  # the overhead is other's


def error(predicted: float | None, live: float | None) -> float | None:
    return (predicted / live - 1.0) * 100.0 if predicted and live else None


def fidelity_rows(
    replayed: LoadedLog,
    lives: Sequence[tuple[str, LoadedLog]],
    attribute_overhead: bool = False,
    client_gaps: bool = False,
    windowed: bool = True,
) -> list[list[str]]:
    """One row per live log and concurrency: live / predicted / self-replay tok/s and errors (and the
    decode tok/s predicted with the live log's overhead model, when ``attribute_overhead``)."""
    rows = []
    for name, live in lives:
        policy = live.run.settings.policy
        if policy is None:
            rows.append([name, "–", "no policy recorded", *["–"] * (11 if attribute_overhead else 9)])
            continue
        measured, predicted, own = (
            live_rates(live),
            predicted_rates(replayed, policy, client_gaps, windowed, live.run.settings),
            predicted_rates(live, policy, client_gaps, windowed),
        )
        swapped = (
            predicted_rates(with_overhead(replayed, live), policy, client_gaps, windowed, live.run.settings)
            if attribute_overhead
            else {}
        )
        for n in sorted(measured, key=lambda n: (n == 0, n)):
            m, p, s = measured[n], predicted.get(n, Rate()), own.get(n, Rate())
            rows.append([
                f"{name} (`{policy_label(policy)}`)", "all" if n == 0 else str(n),
                fmt(m.tokens_per_s, 1), fmt(p.tokens_per_s, 1), fmt(error(p.tokens_per_s, m.tokens_per_s), 1),
                fmt(s.tokens_per_s, 1), fmt(error(s.tokens_per_s, m.tokens_per_s), 1),
                fmt(m.decode_tokens_per_s, 1), fmt(p.decode_tokens_per_s, 1),
                fmt(error(p.decode_tokens_per_s, m.decode_tokens_per_s), 1),
                "–" if p.thin_share is None else f"{100 * p.thin_share:.0f}",
            ])  # fmt: skip
            if attribute_overhead:
                o = swapped.get(n, Rate())
                rows[-1] += [
                    fmt(o.decode_tokens_per_s, 1),
                    fmt(error(o.decode_tokens_per_s, m.decode_tokens_per_s), 1),
                ]
    return rows


HEADER = ["live config (policy)", "N", "live tok/s", "predicted tok/s", "error %", "self-replay tok/s",
          "self error %", "live decode tok/s", "predicted decode tok/s", "decode error %",
          f"% steps priced from < {THIN_STEPS} logged"]  # fmt: skip
ATTRIBUTION = ["decode tok/s, live log's overhead model", "its error %"]


def passes_note(log: LoadedLog, name: str) -> str:
    shown = ", ".join(f"N={x.p.concurrency}: {len(x.p.keys)}" for x in log.passes)
    return f"- passes of `{name}` (N: requests): {shown}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], prog="python -m specsched.bench.replay_fidelity"
    )
    ap.add_argument("--replayed", required=True, help="the log whose bits and cost model predict")
    ap.add_argument("--live", action="append", default=[], help="a live log to compare with (repeat)")
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--seed", type=int, default=0, help="of the imputed match bits")
    ap.add_argument("--cost-error", action="store_true", help="also the held-out cost-model error table")
    ap.add_argument("--attribute-overhead", action="store_true",
                    help="add decode tok/s predicted with the live log's overhead model")  # fmt: skip
    ap.add_argument("--client-gaps", action="store_true",
                    help="replay each client's recorded round trip between its requests")  # fmt: skip
    ap.add_argument("--no-window", action="store_true",
                    help="replay a pass's recorded requests once each, not its clients sending for as "
                         "long as they did live")  # fmt: skip
    ap.add_argument("--no-bucket-bias", action="store_true",
                    help="cost models without the per-graph residual (policies/bucket_bias.py)")  # fmt: skip
    ap.add_argument("--keep-decide-spill", action="store_true",
                    help="replay every policy on the recorded costs, the replayed policy's decide spill "
                         "included (policies/replay.py: costs_for)")  # fmt: skip
    args = ap.parse_args(argv)
    names = [log_name(p) for p in args.live]
    bias = not args.no_bucket_bias
    replayed = load_log(
        args.replayed, seed=args.seed, bucket_bias=bias, decide_spill=not args.keep_decide_spill
    )
    lives = [
        (n, replayed if p == args.replayed else load_log(p, seed=args.seed, bucket_bias=bias))
        for n, p in zip(names, args.live)
    ]
    header = HEADER + ATTRIBUTION * args.attribute_overhead
    rows = fidelity_rows(replayed, lives, args.attribute_overhead, args.client_gaps, not args.no_window)
    parts = [f"Replayed log: `{log_name(args.replayed)}`.", "", table(header, rows), "",
             passes_note(replayed, log_name(args.replayed))]  # fmt: skip
    if args.cost_error:
        from specsched.bench.cost_error_table import cost_error_markdown

        paths = list(dict.fromkeys([args.replayed, *args.live]))
        parts += ["", cost_error_markdown([(log_name(p), load_run(p)) for p in paths])]
    text = "\n".join(parts) + "\n"
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
