"""Offline replay: re-run the step loop's decisions of a recorded run under other policies.

Terms. A request's *output index* m names its m-th output token (m = 0: the token its prefill
sampled). A decode step whose input is output token s drafts indices s+1..s+k and accepts a of
them. Under greedy verification with a deterministic draft (a draft model), whether the draft at
index m equals the target's token depends only on the committed tokens before m, so it is a
property of the position, its *match bit*, whatever k reached it (DESIGN.md, "SQLite log"). A
recorded step therefore fixes bits s+1..s+a to 1 and, when a < k, bit s+a+1 to 0; the bonus token
of a fully accepted step, and any position no draft reached, stays unknown. Unknown bits are
*imputed* once per run, before any policy is replayed, so that every policy sees the same world:
a seeded Bernoulli draw (``random.Random(f"{seed}:{request index}")``) with p = the request's Beta
posterior mean over its known bits, whose prior is the run's mean over all known bits with the
weight of ``PRIOR_STRENGTH`` observations (the expectation of the acceptance estimators in
``policies.acceptance``). For an n-gram proposer, drafts depend on where the match started, so the
bits are an approximation, and the most a request can draft at index s (its match length) is the
k recorded at s when a step started there, else the configured max k.

The replay (:func:`simulate`) batches continuously: requests join in their first-step order while
fewer than ``scheduler.max_num_seqs`` run, and leave at their recorded output length. Each decode
step builds a :class:`BatchView`, asks the policy, reads the match bits to get each request's
accepted count, and charges the step the cost model's predicted ms; the cost model is refitted from
the run's measured step timings (:func:`refit_costs`). Prefill steps are taken from the recording,
with their measured time, for every policy alike.
"""

from __future__ import annotations

import json
import random
import sqlite3
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specsched.daemon.config import SchedulerConfig, SpecConfig
from specsched.daemon.log import SCHEMA_VERSION, LogFormatError, open_log
from specsched.daemon.records import StepRecord, StepRequestRecord
from specsched.policies.acceptance import AcceptanceEstimator
from specsched.policies.base import BatchView, Policy, RequestView
from specsched.policies.cost_model import CostModels, StepShape
from specsched.policies.registry import POLICIES, build_policy

PRIOR_STRENGTH = 2.0  # pseudo-observations of the run mean in a request's imputation rate
_UNBOUNDED = 1 << 30
_MEASURED = ("propose_ms", "score_ms", "verify_ms", "total_ms")
_STEP_COLUMNS = (
    "step kind start_time batch_size num_tokens scorer policy proposer is_synthetic predicted_propose_ms "
    "predicted_score_ms predicted_verify_ms predicted_ms propose_ms score_ms verify_ms total_ms num_emitted"
).split()


class ReplayError(ValueError):
    """The log cannot be replayed (no runs, unknown run id, damaged rows); the message says why."""


@dataclass
class RunSettings:
    """What the replay needs from the run's config (either the app layout of ``specsched-serve``,
    ``proposer.name``/``scorer.names``, or the engine's ``spec.*``); ``defaulted`` names the
    settings the config did not hold."""

    proposer: str
    max_k: int
    max_num_seqs: int
    scorers: list[str]
    block_size: int
    num_blocks: int | None  # None: sized from memory at the time; the replay does not limit blocks
    policy: dict | None  # the recorded policy's config
    graph_buckets: dict[str, list[int]] = field(default_factory=dict)
    defaulted: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict, steps: Sequence[StepRecord]) -> RunSettings:
        def get(path: str):
            node = config
            for part in path.split("."):
                node = node.get(part) if isinstance(node, Mapping) else None
            return node

        defaulted: list[str] = []

        def pick(name: str, paths: tuple[str, ...], default):
            for p in paths:
                if get(p) is not None:
                    return get(p)
            defaulted.append(name)
            return default

        decode = [s for s in steps if s.kind == "decode"]
        used = sorted({s.scorer for s in decode if s.scorer})
        policy = get("policy") if isinstance(get("policy"), Mapping) else None
        labels = {s.policy for s in decode if s.policy}
        if policy is None and len(labels) == 1 and next(iter(labels)) in POLICIES:
            policy = {"name": next(iter(labels))}  # the label the steps carry, with default options
            defaulted.append("policy options")
        return cls(
            proposer=str(pick("proposer", ("proposer.name", "spec.proposer"), SpecConfig().proposer)),
            max_k=int(pick("max_k", ("proposer.max_k", "spec.max_k"), SpecConfig().max_k)),
            max_num_seqs=int(
                pick("max_num_seqs", ("scheduler.max_num_seqs",), SchedulerConfig().max_num_seqs)
            ),
            scorers=list(pick("scorers", ("scorer.names", "spec.scorers"), used or SpecConfig().scorers)),
            block_size=int(pick("block_size", ("cache.block_size",), 16)),
            num_blocks=get("cache.num_blocks"),
            policy=dict(policy) if policy is not None else None,
            defaulted=defaulted,
        )


@dataclass
class RecordedRequest:
    key: str  # unique in the run: the request id, with "#n" appended when a client reused it
    prompt_len: int
    output_len: int  # output tokens (the prefill's first token included)
    first_step: int | None  # its first decode step; None when it finished at prefill
    bits: list[int | None]  # [output_len] match bit per output index; None = unknown
    recorded_k: dict[int, int] = field(default_factory=dict)  # start index s -> k recorded there
    is_finished: bool = True  # False: no `requests` row (still running when the log ended)

    @property
    def num_draftable(self) -> int:
        """Indices a draft can reach: 1..output_len-2 (the last token is always a target token)."""
        return max(self.output_len - 2, 0)


@dataclass
class RecordedRun:
    path: str
    run_id: int
    model: str
    device: str
    version: str
    settings: RunSettings
    steps: list[StepRecord]  # every step, in order
    requests: list[RecordedRequest]  # in first-step order
    num_conflicts: int = 0  # bits that recorded steps disagree on (sampled or n-gram drafts)

    @property
    def decode_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if s.kind == "decode" and s.requests]

    @property
    def prefill_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if s.kind == "prefill"]


def load_run(path: str, run_id: int | None = None) -> RecordedRun:
    """Read run ``run_id`` (None: the latest) of a decision log. Raises :class:`LogFormatError` for a
    file that is not a log of this schema version, :class:`ReplayError` for anything else."""
    db = open_log(path)
    try:
        return _load(db, str(path), run_id)
    except sqlite3.DatabaseError as e:
        raise LogFormatError(f"{path}: damaged log ({e})") from e
    except (ReplayError, LogFormatError):
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ReplayError(f"{path}: damaged log (unexpected row contents: {e!r})") from e
    finally:
        db.close()


def _load(db, path: str, run_id: int | None) -> RecordedRun:
    ids = [r[0] for r in db.execute("select id from runs order by id")]
    if not ids:
        raise ReplayError(f"{path}: the log holds no runs")
    run_id = ids[-1] if run_id is None else run_id
    if run_id not in ids:
        raise ReplayError(f"{path}: no run {run_id}; runs in this log: {', '.join(map(str, ids))}")
    run = next(db.query("select * from runs where id = ?", [run_id]))
    if run["schema_version"] != SCHEMA_VERSION:
        raise LogFormatError(
            f"{path}: run {run_id} was written with log schema version {run['schema_version']}; "
            f"this specsched reads version {SCHEMA_VERSION}"
        )
    try:
        config = json.loads(run["config"] or "{}")
    except json.JSONDecodeError as e:
        raise ReplayError(f"{path}: run {run_id} has an unreadable config ({e})") from e
    steps: dict[int, StepRecord] = {}
    for row in db.query(
        f"select {', '.join(_STEP_COLUMNS)} from steps where run_id = ? order by step", [run_id]
    ):
        for name in _MEASURED:  # NULL measured times count as 0 ms
            row[name] = row[name] or 0.0
        row["is_synthetic"] = bool(row["is_synthetic"])
        steps[row["step"]] = StepRecord(**row)
    rows: dict[str, list[tuple[int, StepRequestRecord]]] = {}
    for r in db.query(
        "select step, request_id, context_len, k, num_accepted from step_requests"
        " where run_id = ? order by step",
        [run_id],
    ):
        q = StepRequestRecord(r["request_id"], r["context_len"], r["k"], r["num_accepted"])
        if r["step"] in steps:
            steps[r["step"]].requests.append(q)
        rows.setdefault(q.request_id, []).append((r["step"], q))
    finished = list(
        db.query(
            "select request_id, arrival, finish_time, prompt_tokens, output_tokens"
            " from requests where run_id = ? order by arrival",
            [run_id],
        )
    )
    ordered = list(steps.values())
    settings = RunSettings.from_config(config, ordered)
    settings.graph_buckets = _saved_buckets(db, run_id)
    requests, conflicts = _requests(rows, finished, steps)
    return RecordedRun(
        path,
        run_id,
        run["model"] or "?",
        run["device"] or "?",
        run["version"] or "?",
        settings,
        ordered,
        requests,
        conflicts,
    )


def _saved_buckets(db, run_id: int) -> dict[str, list[int]]:
    if "cost_models" not in db.table_names() or "graph_buckets" not in db["cost_models"].columns_dict:
        return {}
    row = db.execute("select graph_buckets from cost_models where run_id = ? limit 1", [run_id]).fetchone()
    return json.loads(row[0]) if row and row[0] else {}


def _requests(rows, finished, steps) -> tuple[list[RecordedRequest], int]:
    """One :class:`RecordedRequest` per life of a request id (a reused id is split by the times of
    its `requests` rows), with its match bits; plus the number of conflicting bits."""
    by_id: dict[str, list[dict]] = {}
    for f in finished:
        by_id.setdefault(f["request_id"], []).append(f)
    lives: list[tuple[str, dict | None, list[tuple[int, StepRequestRecord]]]] = []
    for rid in dict.fromkeys([*rows, *by_id]):
        recs, done = rows.get(rid, []), by_id.get(rid, [])
        if len(done) <= 1:
            lives.append((rid, done[0] if done else None, recs))
            continue
        for n, f in enumerate(done):  # a reused id: its steps fall inside the life's [arrival, finish]
            mine = [(s, q) for s, q in recs if f["arrival"] <= steps[s].start_time <= f["finish_time"]]
            lives.append((rid if n == 0 else f"{rid}#{n + 1}", f, mine))
    out, conflicts = [], 0
    for key, f, recs in lives:
        prompt = recs[0][1].context_len if recs else int(f["prompt_tokens"] or 0)
        length = 1 + sum(q.num_accepted + 1 for _, q in recs) if f is None else int(f["output_tokens"] or 0)
        if recs:  # never shorter than what the steps before its last one committed
            length = max(length, recs[-1][1].context_len - prompt + 2)
        bits: list[int | None] = [None] * length
        recorded_k: dict[int, int] = {}
        for _, q in recs:
            s = q.context_len - prompt
            recorded_k.setdefault(s, q.k)
            for i in range(min(q.k, q.num_accepted + 1)):  # i < a matched; i == a < k did not
                m, b = s + 1 + i, int(i < q.num_accepted)
                if 0 < m < length:
                    conflicts += bits[m] is not None and bits[m] != b
                    bits[m] = b if bits[m] is None else bits[m]
        first = recs[0][0] if recs else None
        out.append(RecordedRequest(key, prompt, length, first, bits, recorded_k, f is not None))
    out.sort(key=lambda r: (r.first_step is None, r.first_step or 0))
    return out, conflicts


@dataclass
class MatchBits:
    """The completed bits of every request (recorded where known, imputed elsewhere)."""

    bits: list[list[bool]]  # per request [output_len]
    imputed: list[list[bool]]  # per request [output_len]: True where drawn, not recorded
    run_mean: float  # share of 1s among the recorded bits (the imputation prior)
    num_draftable: int
    num_imputed: int  # of the draftable positions
    seed: int = 0

    @property
    def imputed_share(self) -> float:
        return self.num_imputed / self.num_draftable if self.num_draftable else 0.0


def complete_bits(run: RecordedRun, seed: int = 0) -> MatchBits:
    """Impute every unknown bit (see the module docstring): deterministic for a given ``seed``."""
    known = [b for r in run.requests for b in r.bits[1 : r.output_len - 1] if b is not None]
    run_mean = sum(known) / len(known) if known else 0.5
    bits, imputed, num_imputed = [], [], 0
    for i, r in enumerate(run.requests):
        mine = [b for b in r.bits[1 : r.output_len - 1] if b is not None]
        p = (sum(mine) + PRIOR_STRENGTH * run_mean) / (len(mine) + PRIOR_STRENGTH)
        rng = random.Random(f"{seed}:{i}")
        draws = [rng.random() < p for _ in r.bits]  # one draw per position, used or not: stable
        bits.append([bool(b) if b is not None else d for b, d in zip(r.bits, draws, strict=True)])
        imputed.append([b is None for b in r.bits])
        num_imputed += sum(imputed[-1][1 : r.output_len - 1])
    return MatchBits(bits, imputed, run_mean, sum(r.num_draftable for r in run.requests), num_imputed, seed)


def refit_costs(run: RecordedRun, forgetting: float = 1.0) -> CostModels:
    """Cost models fitted on the run's decode steps, from the device's seed coefficients
    (``forgetting`` 1.0: every step weighs the same, the run is taken as stationary)."""
    device = "cuda" if run.device.startswith("cuda") else "cpu"
    costs = CostModels(run.settings.graph_buckets or None, device=device, forgetting=forgetting)
    for rec in run.decode_steps:
        try:
            costs.observe(rec)
        except ValueError as e:
            raise ReplayError(f"{run.path}: damaged step rows in run {run.run_id} ({e})") from e
    return costs


@dataclass
class StepTrace:
    """One decode step of a row (for the plots)."""

    batch_size: int
    mean_k: float
    scorer: str
    predicted_ms: float
    measured_ms: float | None = None


@dataclass
class PolicyResult:
    """One row of the replay table."""

    label: str
    source: str  # "recorded" (the log as it is) | "replayed"
    num_steps: int = 0  # decode steps
    num_prefill_steps: int = 0
    num_tokens: int = 0  # output tokens, the prefills' first tokens included
    num_decode_tokens: int = 0
    num_request_steps: int = 0  # (request, decode step) pairs
    num_drafts: int = 0
    predicted_ms: float = 0.0  # decode steps predicted + prefill steps measured
    measured_ms: float | None = None  # recorded row only
    scorer_steps: dict[str, int] = field(default_factory=dict)
    num_bits_read: int = 0
    num_bits_imputed: int = 0
    error: str | None = None
    trace: list[StepTrace] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return self.num_decode_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / (self.predicted_ms / 1e3) if self.predicted_ms > 0 else 0.0

    @property
    def measured_tokens_per_s(self) -> float | None:
        return self.num_tokens / (self.measured_ms / 1e3) if self.measured_ms else None

    @property
    def mean_k(self) -> float:
        return self.num_drafts / self.num_request_steps if self.num_request_steps else 0.0

    @property
    def imputed_share(self) -> float | None:
        return self.num_bits_imputed / self.num_bits_read if self.num_bits_read else None


def _base_result(run: RecordedRun, label: str, source: str) -> PolicyResult:
    prefill = run.prefill_steps
    return PolicyResult(
        label, source, num_prefill_steps=len(prefill), predicted_ms=sum(s.total_ms for s in prefill)
    )


def recorded_result(run: RecordedRun, costs: CostModels) -> PolicyResult:
    """The log as it is: measured total, and the refitted model's prediction for the same steps."""
    res = _base_result(run, policy_label(run.settings.policy) if run.settings.policy else "?", "recorded")
    res.measured_ms = sum(s.total_ms for s in run.steps)
    for rec in run.decode_steps:
        ks, ctx = [q.k for q in rec.requests], [q.context_len + 1 for q in rec.requests]
        pred = costs.predict(rec.scorer, rec.proposer or run.settings.proposer, StepShape(ks, ctx)).total_ms
        res.predicted_ms += pred
        res.trace.append(StepTrace(len(ks), sum(ks) / len(ks), rec.scorer, pred, rec.total_ms))
        res.num_steps += 1
        res.num_request_steps += len(ks)
        res.num_drafts += sum(ks)
        res.scorer_steps[rec.scorer] = res.scorer_steps.get(rec.scorer, 0) + 1
    res.num_tokens = sum(r.output_len for r in run.requests)
    res.num_decode_tokens = sum(max(r.output_len - 1, 0) for r in run.requests)
    return res


def policy_label(cfg: Mapping | None) -> str:
    """``fixed k=3``: the policy's name (or ``_target_``) and the options that differ from its defaults."""
    if not cfg:
        return "?"
    options = dict(cfg)
    name = str(options.pop("name", None) or options.pop("_target_", "?"))
    options.pop("_target_", None)
    cls = POLICIES.get(name)
    defaults = vars(cls.config_cls()) if cls is not None and hasattr(cls, "config_cls") else {}
    shown = [f"{k}={v}" for k, v in options.items() if k not in defaults or defaults[k] != v]
    return " ".join([name, *shown])


@dataclass
class _Live:
    index: int  # into run.requests
    req: RecordedRequest
    s: int = 0  # output index of the step's input token (output tokens so far - 1)
    last_k: int = 0
    last_accepted: int = 0


def _max_k(live: _Live, settings: RunSettings) -> int:
    cap = min(settings.max_k, live.req.output_len - live.s - 2)  # leave the last token to the target
    if settings.proposer == "none":
        return 0
    if settings.proposer == "ngram":  # the match length: as recorded at this index, else unknown
        cap = min(cap, live.req.recorded_k.get(live.s, settings.max_k))
    return max(cap, 0)


def simulate(
    run: RecordedRun,
    bits: MatchBits,
    policy: Policy,
    costs: CostModels,
    label: str,
    scorers: Sequence[str] | None = None,
) -> PolicyResult:
    """Replay the run's requests under ``policy`` (see the module docstring). Raises ``ValueError``
    when the policy cannot run here (e.g. it names a scorer that ``scorers`` lacks)."""
    st = run.settings
    scorers = list(scorers or st.scorers)
    res = _base_result(run, label, "replayed")
    acceptance = AcceptanceEstimator()
    waiting, running = deque(range(len(run.requests))), []
    while waiting or running:
        while waiting and len(running) < st.max_num_seqs:
            i = waiting.popleft()
            live = _Live(i, run.requests[i])
            res.num_tokens += min(live.req.output_len, 1)
            if live.req.output_len > 1:
                running.append(live)
        if not running:
            continue
        ctx = [live.req.prompt_len + live.s + 1 for live in running]
        held = sum(-(-c // st.block_size) for c in ctx)
        free = _UNBOUNDED if st.num_blocks is None else max(st.num_blocks - 1 - held, 0)
        views = [
            RequestView(
                live.req.key,
                c,
                st.proposer,
                _max_k(live, st),
                acceptance.mean(live.req.key, st.proposer),
                acceptance.std(live.req.key, st.proposer),
                live.last_k,
                live.last_accepted,
            )
            for live, c in zip(running, ctx, strict=True)
        ]
        plan = policy.decide(BatchView(views, free, st.block_size, scorers, res.num_steps), costs)
        if len(plan.k) != len(views) or plan.scorer not in scorers:
            raise ValueError(
                f"policy {label!r} returned {len(plan.k)} k for {len(views)} requests and scorer "
                f"{plan.scorer!r} (available: {', '.join(scorers)})"
            )
        ks = [min(k, v.max_k) for k, v in zip(plan.k, views, strict=True)]
        pred = costs.predict(plan.scorer, st.proposer, StepShape(ks, ctx)).total_ms
        accepted = []
        for live, k in zip(running, ks, strict=True):
            a, world, imputed = 0, bits.bits[live.index], bits.imputed[live.index]
            for m in range(live.s + 1, live.s + 1 + k):
                res.num_bits_read += 1
                res.num_bits_imputed += imputed[m]
                if not world[m]:
                    break
                a += 1
            emitted = min(a + 1, live.req.output_len - 1 - live.s)
            acceptance.observe(live.req.key, st.proposer, k, a)
            live.s, live.last_k, live.last_accepted = live.s + emitted, k, a
            res.num_tokens, res.num_decode_tokens = res.num_tokens + emitted, res.num_decode_tokens + emitted
            accepted.append(a)
        policy.observe(plan, accepted)
        res.num_steps += 1
        res.num_request_steps += len(ks)
        res.num_drafts += sum(ks)
        res.predicted_ms += pred
        res.scorer_steps[plan.scorer] = res.scorer_steps.get(plan.scorer, 0) + 1
        res.trace.append(StepTrace(len(ks), sum(ks) / len(ks), plan.scorer, pred))
        for live in [x for x in running if x.s >= x.req.output_len - 1]:
            running.remove(live)
            acceptance.forget(live.req.key)
    return res


@dataclass
class ReplayOptions:
    seed: int = 0  # of the imputation draws
    scorers: list[str] | None = None  # scorers the policies may pick; None = the run's
    forgetting: float = 1.0  # of the refitted cost model

    def __post_init__(self) -> None:
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"replay forgetting must be in (0, 1], got {self.forgetting}")
        if self.scorers is not None and not self.scorers:
            raise ValueError("replay scorers must name at least one scorer (or be null for the run's)")


@dataclass
class ReplayReport:
    run: RecordedRun
    bits: MatchBits
    costs: CostModels
    rows: list[PolicyResult]  # recorded, recorded policy replayed, then the alternatives
    fit_steps: dict[str, int]  # scorer -> recorded decode steps the cost model was fitted on


def default_policies() -> list[dict]:
    """Every built-in policy with its default settings."""
    return [{"name": name} for name in POLICIES]


def replay(
    run: RecordedRun, policies: Sequence[Mapping] | None = None, options: ReplayOptions | None = None
) -> ReplayReport:
    """The replay table's rows for ``policies`` (policy configs as for ``build_policy``; None: every
    built-in). A policy that cannot be built or run here gets a row with its ``error``."""
    opts = options or ReplayOptions()
    bits = complete_bits(run, opts.seed)
    costs = refit_costs(run, opts.forgetting)
    rows = [recorded_result(run, costs)]
    configs = ([run.settings.policy] if run.settings.policy else []) + [
        dict(p) for p in policies or default_policies()
    ]
    for cfg in configs:
        label = policy_label(cfg)
        try:
            rows.append(simulate(run, bits, build_policy(cfg), costs, label, opts.scorers))
        except ValueError as e:
            rows.append(PolicyResult(label, "replayed", error=str(e)))
    fit = Counter(s.scorer for s in run.decode_steps)
    return ReplayReport(run, bits, costs, rows, dict(fit))
