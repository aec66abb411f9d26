"""The engine: continuous batching with speculative decoding, one step at a time.

The step (DESIGN.md): schedule -> peek -> decide -> propose -> score -> verify -> commit -> log.
Prefill steps (chunked) run the target over new prompts and sample each request's first token;
decode steps speculate with the plan's k per request and scorer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specsched.engine.commit import CommitStep
from specsched.engine.components import EngineParts, build_parts
from specsched.engine.config import EngineConfig
from specsched.engine.multi_step import DecodeSteps
from specsched.engine.planning import Planner
from specsched.engine.policy_views import PolicyViews
from specsched.engine.prefill import PrefillStep
from specsched.engine.proposing import by_proposer, propose
from specsched.engine.records import RequestOutput, StepRecord
from specsched.engine.request import FinishReason, Request, SamplingParams, SpecParams
from specsched.engine.scheduler import Scheduler
from specsched.engine.stats import EngineStats
from specsched.engine.step_timer import StepTimer
from specsched.policies.base import BatchView, Plan, Policy
from specsched.policies.fixed import predict_plan
from specsched.proposers.base import Proposals


class Engine(PrefillStep, DecodeSteps, CommitStep, PolicyViews):
    def __init__(
        self, cfg: EngineConfig, parts: EngineParts | None = None, policy: Policy | None = None
    ) -> None:
        self.cfg = cfg
        p = parts or build_parts(cfg)
        self.model, self.tokenizer, self.kv_cache = p.model, p.tokenizer, p.kv_cache
        self.proposers, self.scorers, self.costs, self.acceptance = (
            p.proposers,
            p.scorers,
            p.costs,
            p.acceptance,
        )
        self.policy = policy or p.policy
        self.model_name, self.device = p.model_name, p.device
        self.max_model_len = p.max_model_len
        self.warmup = p.warmup  # engine.warmup.WarmupReport, or None when no warm-up ran
        self.prefill_runner = p.prefill_runner  # prefill chunks on graphs (None: eager)
        self.eos_token_ids = set(p.eos_token_ids)
        runner = p.prefill_runner  # keep every prefill step on its graphs
        limits = (runner.max_rows, runner.max_tokens) if runner is not None else None
        self.scheduler = Scheduler(cfg.scheduler, cfg.cache, p.num_blocks, prefill_limits=limits)
        self.requests: dict[str, Request] = {}
        self.on_step: Callable[[StepRecord], None] | None = None
        # called right before each step's host read of the device's results (verification, which
        # reads inside), where the engine thread waits without the interpreter lock: the daemon paces
        # the decision log's writer (log.pace=step) and the IO thread's sends (send_pace=step) by it
        self.on_device_wait: Callable[[], None] | None = None
        # called once per step while the device runs its forward (right after the launch, before the
        # engine's own overlapped work): the daemon handles the last step's outputs there
        # (daemon.output_pace=window). It must not change the engine's requests (no abort_request).
        self.on_host_window: Callable[[], None] | None = None
        # a decode step's record (its requests' rows, the engine's stats, on_step) is completed in the
        # next step's window instead of before the step returns (the daemon sets it with
        # daemon.output_pace=window); an idle engine completes it at once
        self.is_record_deferred = False
        self._unrecorded: tuple | None = None  # (record, _record's arguments, plan) of the last step
        self.stats = EngineStats()
        self.timer = StepTimer(self.device)  # phase times: perf_counter on the host, CUDA events on GPU
        self.is_overlapped_observe = self.timer.is_events  # see flush_observations
        mode, sc = cfg.scheduler.plan_ahead, cfg.scheduler
        is_plan_ahead = mode == "on" or (mode == "auto" and self.timer.is_events)  # see _while_scoring
        self.planner = Planner(
            sc.decide_budget, sc.max_plan_age, is_plan_ahead, sc.max_joined_share, sc.decide_cost == "host",
            sc.plan_ahead_max_batch, is_spill_counted=sc.decide_cost == "exposed",
            is_backoff=sc.decide_backoff, is_late_carry=sc.carry_late_due,
        )  # fmt: skip
        self._unobserved: list[StepRecord] = []
        self._last_end: float | None = None  # perf_counter at the end of the last step, while busy
        self.num_steps = 0
        self._is_after_run = False  # the last decode step drafted nothing (a run, or one plain step)
        # EMA: ms a plain forward alone took (scheduler.plain_decode_ms caps a lone request's run by it)
        self._plain_forward_ms: float | None = None

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> Engine:
        return cls(cfg)

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        n, vocab = req.num_prompt_tokens, self.model.cfg.vocab_size
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens; the model's context is {self.max_model_len} (prompt + output)"
            )
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            raise ValueError(
                f"prompt token ids must be in [0, {vocab}), got {min(req.prompt_ids)}..{max(req.prompt_ids)}"
            )
        if req.proposer is not None and req.proposer not in self.proposers:
            raise ValueError(
                f"unknown proposer {req.proposer!r}; available: {', '.join(sorted(self.proposers))}"
            )
        if self.scheduler.blocks_for(n + 1) > self.scheduler.allocator.num_usable:
            raise ValueError(f"prompt of {n} tokens needs more KV blocks than the cache has")
        # a request alone must always fit the KV cache (else it could be preempted forever)
        capacity = self.scheduler.allocator.num_usable * self.cfg.cache.block_size
        req.sampling.max_tokens = min(req.sampling.max_tokens, self.max_model_len - n, capacity - n)
        req.arrival_time = req.arrival_time or time.time()
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, reason)
        return RequestOutput(request_id, [], finish_reason=reason.value)

    # ---- the step -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None or batch.is_prefill:
            self.flush_record()
            self.flush_observations()
        if batch is None:
            self._last_end = None
            return []
        timer = self.timer
        timer.start_step(t0)
        timer.mark("schedule")
        if self._last_end is not None:  # the caller's time since the last step (the daemon's loop)
            timer.host_ms["between"] = (t0 - self._last_end) * 1e3
        if batch.is_prefill:
            outputs, rec = self._prefill(batch)
        else:
            outputs, rec = self._decode(batch.requests)
        timer.finish(rec)  # CUDA: read the phase events (the step's host read waited for them)
        if not batch.is_prefill:
            self.planner.observe(rec.score_ms, timer.host_ms)
        is_deferred = self._unrecorded is not None
        if not is_deferred:
            self._settle(rec)
            timer.mark("stats")
        rec.host_ms = dict(timer.host_ms)
        rec.total_ms = (time.perf_counter() - t0) * 1e3
        self.num_steps += 1
        if not is_deferred and self.on_step is not None:
            self.on_step(rec)
        if is_deferred and not self.requests:  # idle next: no window to wait for
            self.flush_record()
        self._last_end = time.perf_counter() if self.requests else None  # idle next: no gap to time
        return outputs

    def _settle(self, rec: StepRecord) -> None:
        """A complete record's bookkeeping: the cost models' update (now on the host path, in the next
        step's window on CUDA), the engine's stats."""
        if rec.kind == "decode" and rec.batch_size:
            self._unobserved.append(rec)
            if not self.is_overlapped_observe:
                self.flush_observations()
                self.timer.mark("observe")  # the cost models' update, here when not overlapped (CPU)
        self.stats.observe(rec)

    def flush_record(self) -> None:
        """Complete the last decode step's record if it was deferred (``is_record_deferred``): its
        requests' rows, the policy's feedback, the bookkeeping of :meth:`_settle`, then ``on_step``."""
        if self._unrecorded is None:
            return
        (rec, args, plan), self._unrecorded = self._unrecorded, None
        self._record(rec, *args)
        self.policy.observe(plan, [r.num_accepted for r in rec.requests])
        self._settle(rec)
        if self.on_step is not None:
            self.on_step(rec)

    def flush_observations(self) -> None:
        """Feed the cost models the decode records not observed yet. With ``is_overlapped_observe``
        (on CUDA) a decode step's record is observed during the next decode step, on the host while
        the GPU runs that step's scoring forward (the update is then off the step's critical path,
        and the policy decides with the costs of all steps but the last); prefill steps and idle
        calls flush first."""
        for rec in self._unobserved:
            self.costs.observe(rec)
        self._unobserved.clear()

    def _decode(self, reqs: list[Request]) -> tuple[list[RequestOutput], StepRecord]:
        """One decode step: decide -> propose -> score -> verify -> commit -> record."""
        rec, timer = StepRecord(self.num_steps, "decode", time.time(), 0, 0), self.timer
        names = self._proposer_names(reqs)
        view = self._view(reqs, names)
        timer.mark("view")
        plan = self._decide(reqs, view)
        timer.mark("decide")  # the critical path's decide: ~0 when the plan was decided ahead
        # a run of plain steps (engine/multi_step.py) only for a plan that drafts nothing: the view
        # computed its length for this batch already (1 when runs are off)
        num_steps = 1 if any(plan.k) else view.decode_steps
        kept, ks, num_steps = self._reserve(reqs, plan.k, num_steps)  # may lower k or preempt
        views = view.requests  # in batch order
        if len(kept) != len(reqs):  # kept is in batch order
            ids = {id(r) for r in kept}
            views = [v for r, v in zip(reqs, views) if id(r) in ids]
            reqs, names = kept, self._proposer_names(kept)
        timer.mark("reserve")
        with self._timed(rec, "propose_ms"):
            props = self._propose(reqs, ks, names)
        t_launch = time.perf_counter()
        with self._timed(rec, "score_ms", is_adjacent=True):
            scored = self._score(plan.scorer, reqs, props, num_steps)  # logits, or [S, B] tokens
        with self._timed(rec, "verify_ms", is_adjacent=True):  # queued behind the forward; read later
            pending = self._launch_verify(scored, reqs, props, num_steps)
        if self._is_prediction_deferred:  # the costs as the decide saw them: before the observe
            predict_plan(plan, view, self.costs)
        self._while_scoring(reqs, names, views)
        timer.mark("overlap")  # on CUDA while the GPU scores and verifies: off the critical path up to then
        emitted, match_bits = self._read_verify(pending)  # waits for the device
        timer.mark_tail(rec, "verify_ms")
        if len(reqs) == 1 and not any(ks):  # a plain forward alone: what a run of them lasts
            self._observe_plain(time.perf_counter() - t_launch, num_steps)
        outputs = self._commit(reqs, emitted, props.num_draft, names)
        timer.mark("commit")
        args = (reqs, names, plan, props, views, emitted, match_bits, outputs, num_steps, self._is_after_run)
        self._is_after_run = not any(ks)  # drafted nothing: a draft model skipped these tokens
        if self.is_record_deferred:  # completed in the next step's window (flush_record)
            self._unrecorded = (rec, args, plan)
            return outputs, rec
        self._record(rec, *args)
        self.policy.observe(plan, [r.num_accepted for r in rec.requests])
        timer.mark("record")
        return outputs, rec

    def _decide(self, reqs: list[Request], view: BatchView) -> Plan:
        """The step's plan; a policy with ``is_prediction_deferred`` decides without the cost models
        and its plan's prediction is filled while the GPU scores (:meth:`_decode`)."""
        costs = None if self._is_prediction_deferred else self.costs
        plan = self.planner.plan(self.policy, costs, view)
        if plan.scorer not in self.scorers:
            raise ValueError(
                f"policy {plan.policy!r} chose scorer {plan.scorer!r}, which is not built here; "
                f"built: {', '.join(self.scorers)}"
            )
        return plan

    def _while_scoring(self, reqs: list[Request], names: list[str], views: list) -> None:
        """Host work while the GPU scores (CUDA): nothing here waits for it. Observe the last step's
        costs, let the proposers work on the tokens known before the commit (``on_scoring``), and
        decide the next step's plan ahead where the policy allows it (``views``: this step's, whose
        offers below ``spec.max_k`` the planner counts when the batch's size asks for it)."""
        self._open_window()  # the caller's (a run opened it after its first forward already)
        self.flush_record()  # the last step's, when deferred
        if self._unobserved:
            self.flush_observations()
        if self.is_overlapped_observe:  # the GPU scores meanwhile (on the host path: nothing to hide)
            by = by_proposer(names)
            for n, idx in by.items():  # e.g. the n-gram proposer indexes what it can before the commit
                self.proposers[n].on_scoring(reqs if len(by) == 1 else [reqs[i] for i in idx])
        max_k = self.cfg.spec.max_k
        self.planner.decide_ahead(
            self.policy, self.costs, lambda: self._view(reqs, names, is_ahead=True), len(reqs),
            lambda: sum(v.max_k < max_k for v in views),
        )  # fmt: skip

    # ---- helpers ------------------------------------------------------------------------------------
    def _proposer_names(self, reqs: list[Request]) -> list[str]:
        default = self.cfg.spec.proposer
        return [r.spec.proposer or default for r in reqs]  # r.proposer, without the property call

    def _propose(self, reqs: list[Request], ks: list[int], names: list[str]) -> Proposals:
        return propose(self.proposers, reqs, ks, names, self.model.cfg.vocab_size, self.device)

    def _timed(self, rec: StepRecord, field: str, is_adjacent: bool = False) -> StepTimer:
        return self.timer.phase(rec, field, is_adjacent)

    # ---- status -------------------------------------------------------------------------------------
    @property
    def _is_prediction_deferred(self) -> bool:
        return getattr(self.policy, "is_prediction_deferred", False)  # duck-typed policies: no

    @property
    def is_plan_ahead(self) -> bool:
        """The next step's plan is decided while the GPU scores this one (``scheduler.plan_ahead``)."""
        return self.planner.is_plan_ahead

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.scheduler.allocator.num_usable

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams],
        spec: SpecParams | None = None,
    ) -> list[list[int]]:
        """In-process convenience: run the given prompts to completion, return their output ids."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            r = Request(
                f"generate-{self.num_steps}-{i}", list(p), SamplingParams(**vars(sp)), spec or SpecParams()
            )
            self.add_request(r)
            reqs.append(r)
        while any(not r.is_finished for r in reqs):
            self.step()
        return [r.output_ids for r in reqs]
