"""Offline replay, reading side: a recorded run of the decision log and its recorded match bits.

Terms. A request's *output index* m names its m-th output token (m = 0: the token its prefill
sampled). A decode step whose input is output token s drafts indices s+1..s+k and accepts a of
them. Under greedy verification with a deterministic draft (a draft model), whether the draft at
index m equals the target's token depends only on the committed tokens before m, so it is a
property of the position, its *match bit*, whatever k reached it (DESIGN.md, "SQLite log"). A
recorded step therefore fixes bits s+1..s+a to 1 and, when a < k, bit s+a+1 to 0; the bonus token
of a fully accepted step, and any position no draft reached, stays unknown. Unknown bits are
*imputed* once per run, before any policy is replayed, so that every policy sees the same world
(policies/replay_bits.py). For an n-gram proposer, drafts depend on where the match started, so the
bits are an approximation, and the most a request can draft at index s (its match length) is the k
recorded at s when a step started there (inside a step's accepted span, the cap where it started:
:func:`_continue_matches`), else the configured max k.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specsched.engine.config import SchedulerConfig, SpecConfig
from specsched.engine.log_schema import READABLE_VERSIONS, LogFormatError, open_log
from specsched.engine.records import StepRecord, StepRequestRecord
from specsched.policies.registry import POLICIES
from specsched.policies.replay_runs import RunRules

_MEASURED = ("propose_ms", "score_ms", "verify_ms", "total_ms")
# of a step's plan_info, only whether it runs a plan decided ahead and how many steps ran it before
# (policies/replay.py: decide_spill_ms), the plain steps it ran back to back and whether it came
# after such a run (engine/records.py); a plan_info that is not JSON reads as none of them
_PLAN_AHEAD = ", ".join(
    f"case when json_valid(plan_info) then json_extract(plan_info, '$.{key}') end as {key}"
    for key in ("is_planned_ahead", "plan_age", "decode_steps", "is_after_run")
)
_STEP_COLUMNS = (
    "step kind start_time batch_size num_tokens scorer policy proposer is_synthetic predicted_propose_ms "
    "predicted_score_ms predicted_verify_ms predicted_ms propose_ms score_ms verify_ms total_ms num_emitted"
).split()


# a log that names no scorer: the engine default before scorers were chosen by device
_OLD_DEFAULT_SCORERS = ("batch_expansion", "mqa")


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
    runs: RunRules = field(default_factory=RunRules)  # runs of plain steps (policies/replay_runs.py)

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
            scorers=list(pick("scorers", ("scorer.names", "spec.scorers"), used or _OLD_DEFAULT_SCORERS)),
            block_size=int(pick("block_size", ("cache.block_size",), 16)),
            num_blocks=get("cache.num_blocks"),
            policy=dict(policy) if policy is not None else None,
            defaulted=defaulted,
            runs=RunRules.from_scheduler(get("scheduler")),
        )


@dataclass
class RecordedRequest:
    key: str  # unique in the run: the request id, with "#n" appended when a client reused it
    prompt_len: int
    output_len: int  # output tokens (the prefill's first token included)
    first_step: int | None  # its first decode step; None when it finished at prefill
    bits: list[int | None]  # [output_len] match bit per output index; None = unknown
    # start index s -> the cap recorded there: the step's max_k (schema >= 3), else its k (a lower bound)
    recorded_k: dict[int, int] = field(default_factory=dict)
    is_finished: bool = True  # False: no `requests` row (still running when the log ended)
    client: str | None = None  # the `requests` row's client (the daemon's ZeroMQ peer), when logged
    prompt_hash: str | None = None  # the `requests` row's (schema >= 4): lives of one prompt share it

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
    file that is not a log of this schema version, :class:`ReplayError` for anything else. A record of
    a run of plain steps (``num_decode_steps`` > 1) is kept as one record; the replay runs them by the
    run's scheduler options (``settings.runs``, policies/replay_runs.py)."""
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
    if run["schema_version"] not in READABLE_VERSIONS:
        raise LogFormatError(
            f"{path}: run {run_id} was written with log schema version {run['schema_version']}; "
            f"this specsched reads versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    try:
        config = json.loads(run["config"] or "{}")
    except json.JSONDecodeError as e:
        raise ReplayError(f"{path}: run {run_id} has an unreadable config ({e})") from e
    steps: dict[int, StepRecord] = {}
    host = ", host_ms" if "host_ms" in db["steps"].columns_dict else ""  # schema >= 3
    for row in db.query(
        f"select {', '.join(_STEP_COLUMNS)}{host}, {_PLAN_AHEAD} from steps where run_id = ? order by step",
        [run_id],
    ):
        for name in _MEASURED:  # NULL measured times count as 0 ms
            row[name] = row[name] or 0.0
        row["is_synthetic"] = bool(row["is_synthetic"])
        row["host_ms"] = _host_ms(row.pop("host_ms", None))
        is_ahead, age = row.pop("is_planned_ahead"), row.pop("plan_age")
        row["plan_info"] = {"is_planned_ahead": True, "plan_age": age or 0} if is_ahead else {}
        row["num_decode_steps"] = row.pop("decode_steps") or 1
        row["is_after_run"] = bool(row.pop("is_after_run"))
        steps[row["step"]] = StepRecord(**row)
    rows: dict[str, list[tuple[int, StepRequestRecord]]] = {}
    max_k = ", max_k" if "max_k" in db["step_requests"].columns_dict else ""  # schema >= 3
    for r in db.query(
        f"select step, request_id, context_len, k, num_accepted{max_k} from step_requests"
        " where run_id = ? order by step",
        [run_id],
    ):
        q = StepRequestRecord(
            r["request_id"], r["context_len"], r["k"], r["num_accepted"], max_k=r.get("max_k")
        )
        if r["step"] in steps:
            steps[r["step"]].requests.append(q)
        rows.setdefault(q.request_id, []).append((r["step"], q))
    hashed = ", prompt_hash" if "prompt_hash" in db["requests"].columns_dict else ""  # schema >= 4
    finished = list(
        db.query(
            f"select request_id, client, arrival, finish_time, prompt_tokens, output_tokens{hashed}"
            " from requests where run_id = ? order by arrival",
            [run_id],
        )
    )
    ordered = list(steps.values())
    settings = RunSettings.from_config(config, ordered)
    if settings.runs.is_off and any(s.num_decode_steps > 1 for s in ordered):
        settings.defaulted.append("runs")  # its config holds no run options: replayed one step at a time
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


def _host_ms(text: str | None) -> dict[str, float]:
    """A step's ``host_ms`` JSON (its ``between`` is part of what the cost models learn); {} if absent
    or unreadable."""
    try:
        got = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    if not isinstance(got, dict):
        return {}
    return {str(k): float(v) for k, v in got.items() if isinstance(v, (int, float))}


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
            recorded_k.setdefault(s, q.k if q.max_k is None else q.max_k)
            for i in range(min(q.k, q.num_accepted + 1)):  # i < a matched; i == a < k did not
                m, b = s + 1 + i, int(i < q.num_accepted)
                if 0 < m < length:
                    conflicts += bits[m] is not None and bits[m] != b
                    bits[m] = b if bits[m] is None else bits[m]
        _continue_matches(recorded_k, recs, prompt)
        first = recs[0][0] if recs else None
        client, digest = (f.get("client"), f.get("prompt_hash")) if f is not None else (None, None)
        is_finished = f is not None
        out.append(RecordedRequest(key, prompt, length, first, bits, recorded_k, is_finished, client, digest))
    out.sort(key=lambda r: (r.first_step is None, r.first_step or 0))
    return out, conflicts


def _continue_matches(
    recorded_k: dict[int, int], recs: list[tuple[int, StepRequestRecord]], prompt: int
) -> None:
    """The n-gram cap at the output indices a step's accepted drafts skipped (no step started there):
    the cap recorded at ``s``, at every ``s + j`` with ``j <= accepted``. A cap recorded at the index
    wins.

    Why the same cap. The proposer (proposers/ngram.py) offers the continuation of the most recent
    earlier occurrence of the suffix, up to the end of the context, capped at ``max_k``: the cap is
    ``min(L - start, max_k)`` for a context of L tokens and a continuation from ``start``. Once ``j``
    drafts were accepted, the context is ``j`` tokens longer and ends with a copy of that
    continuation, so the occurrence shifted by ``j`` matches the new suffix and its continuation has
    ``(L + j) - (start + j)`` tokens: the same cap, unless a still more recent occurrence wins. The
    replay once took ``cap - j`` (the match used up as drafts are accepted) and, where the cap was
    ``max_k``, extended it from the next step's cap. On the H100 grounded logs of 2026-12-07 17:15, at
    the 1,982 indices where hf_heuristic started a step and goodput had not, the same cap was the live
    one at 1,909 (96 %), ``cap - j`` at 19, and hf_heuristic replayed from goodput's log was 5.0 % low
    at N = 4 with the earlier rule. Without any rule (the configured ``max_k`` at a skipped index)
    fixed k = 5 replayed from goodput's log was 13 % high at N = 16 (H200 logs of 2026-12-04)."""
    for _, q in recs:
        s = q.context_len - prompt
        cap = recorded_k[s]
        for j in range(1, q.num_accepted + 1):
            recorded_k.setdefault(s + j, cap)
