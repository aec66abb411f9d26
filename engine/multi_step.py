"""How many plain decode steps one engine step runs back to back (``scheduler.decode_steps``).

See :mod:`specsched.scorers.multi_step` for how they run. Only a step that drafts nothing for any
request by the policy's choice (not for lack of drafts: see :func:`num_decode_steps`) and whose
requests are all greedy qualifies (a sampled request would need its uniforms and its sampling on the
device between the steps); the count is capped so that no request's positions pass the model's
context. A request that stops inside the run (EOS, a stop id, or its ``max_tokens``) drops the tokens
after its stop at the commit, as a speculative step drops accepted drafts past it: its row computes up
to ``decode_steps - 1`` tokens nobody keeps, where a run cut short for it would run the whole batch
one step at a time. (Under continuous batching some request is near its end on most steps; on the
2026-12-06 H100 log, batch 64, a run was cut to single steps 7-9 times in 150, at 6.3 tokens/ms
against 7.4 in runs.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from specsched.engine.request import Request
from specsched.kernels.pending_read import PendingRead
from specsched.kernels.rejection_sampling import VerifyResult, launch_verify
from specsched.proposers.base import Proposals
from specsched.scorers.base import Scorer
from specsched.scorers.multi_step import greedy_decode_steps

if TYPE_CHECKING:
    from specsched.engine.scheduler import Scheduler


def num_decode_steps(
    reqs: list[Request], ks: list[int], caps: list[int], names: list[str], max_steps: int, max_model_len: int
) -> int:
    """Steps to run for ``reqs`` with planned drafts ``ks``: 1 unless every k is 0, every request is
    greedy, ``max_steps`` > 1 and every request's k = 0 is a choice, not a lack of drafts: its
    proposer is ``none``, its own ``spec.max_k`` is 0, or ``caps[i]``, what its proposer had on offer
    (its ``peek``; not :class:`~specsched.policies.base.RequestView`'s ``max_k``, which a request near
    its ``max_tokens`` has at 0 for lack of room), was above 0 and the policy took none. An n-gram
    proposer without a match this step may have one after the next token: a run would skip it. Then
    ``max_steps`` capped by the context (a token at position p needs p < ``max_model_len``), not by
    ``max_tokens`` in a batch (the commit keeps each request's tokens up to its stop; a run cut for one
    request would run the others one step at a time), but by it for a request decoding alone: there
    the forwards past its ``max_tokens`` buy nothing (on the 2026-12-07 H100 logs the last run of 8 of a
    non-speculative request served alone kept 7, 6, 3 or 2 of its tokens)."""
    if max_steps <= 1 or not reqs or any(ks):
        return 1
    room = max_steps
    for r, cap, name in zip(reqs, caps, names, strict=True):
        s = r.sampling
        if s.temperature != 0.0:  # SamplingParams.is_greedy, inlined
            return 1
        if cap == 0 and name != "none" and r.spec.max_k != 0:
            return 1
        room = min(room, max_model_len - len(r.prompt_ids) - len(r.output_ids) + 1)
    if len(reqs) == 1:  # alone: no other row runs on for it
        room = min(room, reqs[0].sampling.max_tokens - len(reqs[0].output_ids))
    return max(1, room)


class DecodeSteps:
    """The engine's reserve, score and verify phases for one speculative step or a run of
    ``num_steps`` plain steps (a mixin of :class:`~specsched.engine.engine.Engine`)."""

    scheduler: Scheduler
    scorers: dict[str, Scorer]
    device: torch.device
    on_device_wait: Callable[[], None] | None
    on_host_window: Callable[[], None] | None
    _is_woken = False  # on_device_wait ran for this step already (a run's, after its first launch)
    _is_window_open = False  # on_host_window ran for this step already (a run's, after its first launch)

    def _reserve(
        self, reqs: list[Request], ks: list[int], num_steps: int
    ) -> tuple[list[Request], list[int], int]:
        """The step's slots: ``num_tokens + k_i`` per request, or ``num_tokens + num_steps - 1`` for a
        run of plain steps. Returns the requests that stay (batch order), their k and the steps to
        run: a run falls back to one plain step when a request did not get its slots or left."""
        if num_steps == 1:
            return *self.scheduler.reserve_lookahead(reqs, ks), 1
        kept, got = self.scheduler.reserve_lookahead(reqs, [num_steps - 1] * len(reqs))
        if len(kept) != len(reqs) or any(k != num_steps - 1 for k in got):
            num_steps = 1
        return kept, [0] * len(kept), num_steps

    def _score(self, scorer: str, reqs: list[Request], props: Proposals, num_steps: int) -> torch.Tensor:
        """The scoring forward's logits ``[sum(k_i+1), vocab]``, or for a run of ``num_steps`` > 1
        plain steps their argmax tokens ``[num_steps, B]`` (both on the device). A run calls
        ``on_host_window`` and ``on_device_wait`` once its first forward is queued, not after its
        launches and at the read: the host's launches of
        the other forwards take a good part of the run (H200, 2026-12-06, SmolLM2, N = 1, runs of 8:
        2.9 ms of launches in a 7.4 ms run), and the daemon's IO thread, woken by that hook, would
        otherwise stream the last step's tokens (a new request's first one) only after them: TTFT
        p50 6.7 ms against 4.0 without runs."""
        self._is_woken = self._is_window_open = False
        if num_steps == 1:
            return self.scorers[scorer].score(reqs, props)
        s = self.scorers[scorer]
        return greedy_decode_steps(
            s.decode_forward, reqs, num_steps, self.scheduler.block_size, self.device, self._wake_for_run
        )

    def _open_window(self) -> None:
        """The caller's work while the device runs this step (``on_host_window``), once a step: in a
        run right after its first forward is queued (with the wake below), else in the overlap."""
        if self.on_host_window is not None and not self._is_window_open:
            self._is_window_open = True
            self.on_host_window()

    def _wake_for_run(self) -> None:
        self._open_window()
        if self.on_device_wait is not None:
            self._is_woken = True
            self.on_device_wait()

    def _launch_verify(
        self, scored: torch.Tensor, reqs: list[Request], props: Proposals, num_steps: int
    ) -> PendingRead[tuple[list[list[int]], list[str]]]:
        """Queue the step's verification right behind its scoring (the device runs it as soon as the
        forward ends, whatever the host does meanwhile); :meth:`_read_verify` reads it."""
        if num_steps > 1:  # [S, B] tokens: no drafts, nothing matched
            return PendingRead(scored.T, lambda rows: (rows, [""] * len(rows)))
        pending = launch_verify(scored, props, [r.sampling for r in reqs], [r.generator for r in reqs])
        return pending.then(_lists)

    def _read_verify(
        self, pending: PendingRead[tuple[list[list[int]], list[str]]]
    ) -> tuple[list[list[int]], list[str]]:
        """Each request's emitted tokens and match bits, read on the host (the step's one host read).
        ``on_device_wait`` goes first, so that what it wakes runs while this thread waits for the
        device without the interpreter lock — unless the device is done already: the woken threads
        would then hold the lock while this thread wants it back (their turn comes at the next wait).
        A run woke them already (:meth:`_score`)."""
        if self.on_device_wait is not None and not self._is_woken and not pending.is_done:
            self.on_device_wait()
        self._is_woken = False
        return pending.result()


def _lists(result: VerifyResult) -> tuple[list[list[int]], list[str]]:
    return result.to_lists(), result.match_bits()
