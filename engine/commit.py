"""What a decode or prefill step leaves behind: the commit of its tokens (stops, KV trims, finished
requests) and the record of what it did (the decision log's ``steps`` / ``step_requests`` rows).

A mixin of :class:`~specsched.engine.engine.Engine`, as :class:`~specsched.engine.prefill.PrefillStep`
and :class:`~specsched.engine.multi_step.DecodeSteps` are: the engine's step (engine/engine.py) calls
:meth:`CommitStep._commit` and :meth:`CommitStep._record`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specsched.engine.records import RequestOutput, StepRequestRecord
from specsched.engine.request import FinishReason, Request

if TYPE_CHECKING:
    from specsched.engine.scheduler import Scheduler
    from specsched.policies.acceptance import AcceptanceEstimator
    from specsched.proposers.base import Proposer

_NO_IDS: frozenset[int] = frozenset()  # the EOS ids a request that ignores EOS stops at


class CommitStep:
    """The commit and record phases of the engine's step (a mixin of the engine)."""

    scheduler: Scheduler
    proposers: dict[str, Proposer]
    acceptance: AcceptanceEstimator
    requests: dict[str, Request]
    eos_token_ids: set[int]
    max_model_len: int

    def _commit(
        self, reqs: list[Request], emitted: list[list[int]], num_draft: list[int], names: list[str] | None
    ) -> list[RequestOutput]:
        """Append each request's emitted tokens (accepted drafts + one recovered/bonus token), stop
        at EOS/stop ids/length, roll back the KV of rejected drafts by length. ``names``: the
        requests' proposers on a decode step (acceptance is observed), None on a prefill step."""
        outputs, unfinished = [], []
        observe, trim, block_size = self.acceptance.observe, self.scheduler.trim, self.scheduler.block_size
        is_decode = names is not None
        for i, (r, toks, k) in enumerate(zip(reqs, emitted, num_draft)):
            n_acc = min(len(toks) - 1, k)  # a run of plain steps emits several tokens with k = 0
            out = r.output_ids
            num_tokens = len(r.prompt_ids) + len(out)  # before this step's tokens
            kept, reason = self._kept(r, toks)
            out.extend(kept)
            if is_decode:
                r.num_proposed += k
                r.num_accepted += n_acc
                r.num_spec_steps += 1
                r.last_k, r.last_accepted = k, n_acc
                if k:  # k = 0 teaches the estimator nothing (its observe returns at once)
                    observe(r.request_id, names[i], k, n_acc)
            num_tokens += len(kept)
            r.num_computed = num_tokens - 1
            outputs.append(RequestOutput(r.request_id, kept, k, n_acc, reason.value if reason else None))
            if reason is not None:
                self._finish(r, reason)
            else:
                if len(r.block_table) * block_size >= num_tokens + block_size:  # a whole block to free
                    trim(r)
                unfinished.append(r)
        for p in self.proposers.values():
            p.on_commit(unfinished)
        return outputs

    def _kept(self, r: Request, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        """The prefix of ``tokens`` the request keeps, through the first one that stops it (EOS or a
        stop id: STOP; max_tokens or the model's context reached: LENGTH), and that reason."""
        s = r.sampling
        eos, stop_ids = _NO_IDS if s.ignore_eos else self.eos_token_ids, s.stop_token_ids
        num_out = len(r.output_ids)
        # the i-th token reaches max_tokens or the model's context when i >= limit
        limit = min(s.max_tokens - num_out, self.max_model_len - len(r.prompt_ids) - num_out)
        if len(tokens) < limit and not stop_ids and eos.isdisjoint(tokens):  # the common step: all kept
            return tokens, None
        for i, t in enumerate(tokens, 1):
            if t in eos or t in stop_ids:
                return tokens[:i], FinishReason.STOP
            if i >= limit:
                return tokens[:i], FinishReason.LENGTH
        return tokens, None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        for p in self.proposers.values():
            p.on_finish(req)
        self.acceptance.forget(req.request_id)
        self.requests.pop(req.request_id, None)

    def _record(
        self, rec, reqs, names, plan, props, views, emitted, match_bits, outputs, num_steps, is_after_run
    ) -> None:
        """Fill the step's record (the decision log's ``steps`` and ``step_requests`` rows); ``views``:
        the policy's view of each request (batch order): its context (the tokens before this step's)
        and max k. A run of ``num_steps`` plain steps scored ``num_steps`` tokens per request and
        says so in its ``plan_info`` (``decode_steps``). ``is_after_run``: the step before drafted
        nothing. Reads nothing a later step changes (it may run in the next step's window)."""
        rec.requests = [
            StepRequestRecord(
                r.request_id, v.context_len - 1, k, min(len(e) - 1, k), b, len(o.new_token_ids), v.max_k
            )
            for r, v, e, k, b, o in zip(reqs, views, emitted, props.num_draft, match_bits, outputs)
        ]
        rec.batch_size, rec.num_tokens = len(reqs), props.num_tokens + len(reqs) * num_steps
        # flagged on a step that drafts or runs plain steps; a single plain step has no catch-up to time
        rec.num_decode_steps = num_steps
        rec.is_after_run = is_after_run and (num_steps > 1 or any(props.num_draft))
        rec.num_emitted = sum(len(o.new_token_ids) for o in outputs)  # kept: a stop drops what follows it
        rec.scorer, rec.policy, rec.is_synthetic = plan.scorer, plan.policy, props.is_synthetic
        kinds = set(names)
        rec.proposer = names[0] if len(kinds) == 1 else "+".join(sorted(kinds))
        rec.predicted_ms, rec.plan_info = plan.predicted_ms, plan.info
        if num_steps > 1 or rec.is_after_run:  # a copy: the plan's info may be carried to the next step
            rec.plan_info = dict(plan.info)
            if num_steps > 1:
                rec.plan_info["decode_steps"] = num_steps
            if rec.is_after_run:  # a run after a run carries both
                rec.plan_info["is_after_run"] = True
        rec.predicted_propose_ms = plan.info.get("predicted_propose_ms")
        rec.predicted_score_ms = plan.info.get("predicted_score_ms")
        rec.predicted_verify_ms = plan.info.get("predicted_verify_ms")
