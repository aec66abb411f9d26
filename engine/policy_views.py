"""What the policy sees of a decode batch, and how many plain steps a run may take (a mixin of
:class:`~specsched.engine.engine.Engine`).

:meth:`PolicyViews._view` builds the step's :class:`BatchView`: each request's cap (its proposer's
peek, or ``spec.max_k`` for a plan decided ahead), acceptance estimate and room, and the run of plain
steps a plan with every k = 0 would take: ``scheduler.plain_decode_steps`` for a request decoding alone
that cannot draft, ``scheduler.decode_steps`` for a batch small enough
(``decode_steps_max_batch``), each capped by ``scheduler.plain_decode_ms`` over the measured ms of a
plain forward.
"""

from __future__ import annotations

from specsched.engine.multi_step import num_decode_steps
from specsched.engine.proposing import peek_caps, request_views
from specsched.engine.request import Request
from specsched.policies.base import BatchView
from specsched.policies.run_cost import capped_run_steps


class PolicyViews:
    """Reads the engine's ``cfg``, ``proposers``, ``acceptance``, ``scheduler``, ``scorers``,
    ``max_model_len`` and ``num_steps``; keeps ``_plain_forward_ms`` (set None by the engine's
    constructor, until a plain forward is measured)."""

    def _view(self, reqs: list[Request], names: list[str], is_ahead: bool = False) -> BatchView:
        """What the policy sees (:func:`~specsched.engine.proposing.request_views`). ``is_ahead``: the
        view of a plan decided during this step's scoring, for the next step; this step's tokens are
        not committed yet, so a proposer's peek would be a step old (an n-gram match they bring would
        be missed): every request is offered the full ``spec.max_k``, and carrying the plan to the
        next step caps each k by that step's own peek (:func:`~specsched.engine.carry.carry_plan`)."""
        spec = self.cfg.spec
        peek = [spec.max_k] * len(reqs) if is_ahead else peek_caps(self.proposers, reqs, names)
        views = request_views(reqs, names, peek, self.acceptance, spec.max_k, self.max_model_len)
        sched, sched_cfg = self.scheduler, self.cfg.scheduler
        max_steps = sched_cfg.decode_steps
        run = 1
        is_plain = self._is_plain_alone(reqs, names)
        if is_plain:  # scheduler.plain_decode_steps: nothing to draft, as with proposer none
            max_steps, names = max(max_steps, self._plain_steps()), ["none"]
        elif not self._runs_allowed(len(reqs)):
            max_steps = 1
        elif len(reqs) == 1 and max_steps > 1:  # a run alone lasts about plain_decode_ms too
            max_steps = self._plain_steps(max_steps)
        if max_steps > 1 and reqs:  # what a plan with every k = 0 would run (the policy weighs
            # it; the step runs it when its plan drafts nothing); the proposers' own offer, not the
            # views' caps: a request one token from its max_tokens has a cap of 0 for lack of room,
            # which is no reason to run the batch one step at a time
            run = num_decode_steps(reqs, [0] * len(reqs), peek, names, max_steps, self.max_model_len)
        return BatchView(
            views, sched.num_free_blocks, self.cfg.cache.block_size, list(self.scorers), self.num_steps, run,
            self.acceptance,
        )  # fmt: skip

    def _runs_allowed(self, batch_size: int) -> bool:
        """Runs of plain steps for a decode batch of ``batch_size``: at most
        ``scheduler.decode_steps_max_batch`` requests and none waiting (when that is set)."""
        cap = self.cfg.scheduler.decode_steps_max_batch
        return cap is None or (batch_size <= cap and not self.scheduler.waiting)

    def _is_plain_alone(self, reqs: list[Request], names: list[str]) -> bool:
        """A decode batch of one request that cannot draft (proposer none, or its spec.max_k 0) with
        none waiting: it runs ``scheduler.plain_decode_steps`` plain steps at a time."""
        if len(reqs) != 1 or self.cfg.scheduler.plain_decode_steps <= 1 or self.scheduler.waiting:
            return False
        return names[0] == "none" or reqs[0].spec.max_k == 0 or self.cfg.spec.max_k == 0

    def _plain_steps(self, steps: int | None = None) -> int:
        """``steps`` (default ``scheduler.plain_decode_steps``) capped by ``plain_decode_ms`` over the
        measured ms of a plain forward alone (1 before the first is measured)."""
        sched = self.cfg.scheduler
        steps = sched.plain_decode_steps if steps is None else steps
        return capped_run_steps(steps, sched.plain_decode_ms, self._plain_forward_ms)

    def _observe_plain(self, seconds: float, num_steps: int) -> None:
        """A plain step or run alone took ``seconds`` from its scoring launch to its read: the EMA of
        its ms a forward that :meth:`_plain_steps` divides."""
        ms = seconds * 1e3 / num_steps
        old = self._plain_forward_ms
        self._plain_forward_ms = ms if old is None else 0.8 * old + 0.2 * ms
