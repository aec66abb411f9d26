"""How well a decision log's drafts were accepted, by what the policy could know before the step
(issue 13: acceptance estimates).

A draft's acceptance is not one per-token rate a. For request-steps with k > 0 this prints:

- the **first draft's** acceptance by the request's *state* — ``first`` (its first decode step),
  ``none`` (the step before it drafted nothing), ``full`` (the step before kept every draft),
  ``rejected`` (the step before had a draft rejected) — and by the step's *cap* (``max_k`` of the
  policy's view: for the n-gram proposer, how many tokens follow the match);
- the **conditional acceptance by depth**: the share of drafts j accepted among the steps whose
  drafts 0..j-1 were all accepted (an i.i.d. rate a would make it flat);
- the **calibration** of :class:`~specsched.policies.acceptance.AcceptanceEstimator` (replayed over
  the log in step order, as the engine feeds it): expected tokens per step under its mean,
  :func:`~specsched.policies.acceptance.expected_tokens`, over the tokens the steps emitted, per k.

    python -m specsched.bench.acceptance_table LOG.sqlite [LOG.sqlite ...]
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence

from specsched.bench.markdown import fmt, table
from specsched.engine.records import StepRecord
from specsched.policies.acceptance import AcceptanceEstimator, expected_tokens
from specsched.policies.replay_log import load_run

STATES = ("first", "none", "full", "rejected")


def step_state(last: tuple[int, int] | None) -> str:
    """The state a request-step starts in, from the (k, accepted) of the request's step before."""
    if last is None:
        return "first"
    k, accepted = last
    return "none" if k == 0 else "full" if accepted >= k else "rejected"


def request_steps(steps: Iterable[StepRecord]) -> Iterable[tuple[str, StepRecord, object]]:
    """(state, step, request record) of every request-step of the decode steps, in log order."""
    last: dict[str, tuple[int, int]] = {}
    for rec in steps:
        if rec.kind != "decode":
            continue
        for q in rec.requests:
            yield step_state(last.get(q.request_id)), rec, q
            last[q.request_id] = (q.k, q.num_accepted)


def first_draft_counts(steps: Iterable[StepRecord], max_cap: int = 8) -> dict[tuple[str, int], list[int]]:
    """(state, cap) -> [request-steps with k > 0, of them with the first draft accepted]; caps above
    ``max_cap`` count as ``max_cap``; a step without a logged cap counts under its k."""
    out: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    for state, _, q in request_steps(steps):
        if q.k > 0:
            cap = q.max_k if q.max_k is not None else q.k
            cell = out[(state, min(cap, max_cap))]
            cell[0] += 1
            cell[1] += q.num_accepted >= 1
    return dict(out)


def depth_acceptance(steps: Iterable[StepRecord]) -> dict[int, tuple[int, int]]:
    """j -> (steps that reached draft j: drafts 0..j-1 accepted and k > j, of them accepting draft j)."""
    out: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for _, _, q in request_steps(steps):
        for j in range(min(q.k, q.num_accepted + 1)):
            out[j][0] += 1
            out[j][1] += j < q.num_accepted
    return {j: (n, a) for j, (n, a) in sorted(out.items())}


def calibration(
    steps: Iterable[StepRecord], proposer: str, max_k: int = 8
) -> dict[int, tuple[int, float, int]]:
    """k -> (request-steps, expected tokens under the estimator's mean before each, tokens emitted);
    the estimator learns from each step after it is scored, as in the engine."""
    est = AcceptanceEstimator()
    out: dict[int, list] = defaultdict(lambda: [0, 0.0, 0])
    for _, rec, q in request_steps(steps):
        if q.k > 0:
            cell = out[min(q.k, max_k)]
            cell[0] += 1
            cell[1] += expected_tokens(est.mean(q.request_id, rec.proposer or proposer), q.k)
            cell[2] += q.num_accepted + 1
            est.observe(q.request_id, rec.proposer or proposer, q.k, q.num_accepted)
    return {k: (n, e, t) for k, (n, e, t) in sorted(out.items())}


def acceptance_markdown(name: str, steps: Sequence[StepRecord], proposer: str) -> str:
    first = first_draft_counts(steps)
    caps = sorted({c for _, c in first})
    rows = []
    for s in STATES:
        cells = [first.get((s, c)) for c in caps]
        if any(cells):
            total = [sum(c[i] for c in cells if c) for i in (0, 1)]
            rows.append([s, fmt(total[1] / total[0]), str(total[0])]
                        + [fmt(c[1] / c[0]) + f" ({c[0]})" if c else "–" for c in cells])  # fmt: skip
    head = ["state", "first draft", "steps"] + [f"cap {c}" + ("+" if c == 8 else "") for c in caps]
    depth = depth_acceptance(steps)
    cal = calibration(steps, proposer)
    n, e, t = (sum(v[i] for v in cal.values()) for i in range(3))
    return "\n".join([
        f"**{name}**: first draft accepted, by state and cap (steps in brackets)", "",
        table(head, rows), "",
        "Conditional acceptance by depth (j: share of draft j accepted when 0..j-1 were; steps): "
        + ", ".join(f"{j}: {fmt(a / m)} ({m})" for j, (m, a) in depth.items()), "",
        f"Calibration of the per-token estimate: expected / emitted tokens {fmt(e / t if t else None, 3)} "
        f"over {n} request-steps; per k: "
        + ", ".join(f"{k}: {fmt(ek / tk, 2)}" for k, (_, ek, tk) in cal.items()),
    ])  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        sys.stderr.write("usage: python -m specsched.bench.acceptance_table LOG.sqlite [LOG.sqlite ...]\n")
        return 2
    for p in paths:
        run = load_run(p)
        name = p.rsplit("/", 1)[-1].removesuffix(".sqlite")
        sys.stdout.write(acceptance_markdown(name, run.steps, run.settings.proposer) + "\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
