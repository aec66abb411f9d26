"""The search each ``goodput`` decide runs, and the scorers it runs over.

:meth:`SearchScope.search` builds the step's problem:
:class:`~specsched.policies.goodput_single.SingleProblem` (plain Python) at batch 1,
:class:`~specsched.policies.goodput_small.SmallProblem` (plain Python lists) up to
``plain_search_max_batch``, else :class:`~specsched.policies.goodput_search.BatchProblem` (numpy).

*Pruning*: the search's host time grows with the scorers it prices (a decide at batch 64 took ~2 ms
on the H200 host on 2026-12-05), and at large batches a scorer far behind stays far behind (there:
the MQA graph 28 tokens/ms, eager MQA 4.7, batch expansion 2.9). :meth:`SearchScope.problem`
searches only the scorers whose best goodput at the last full search was at least ``prune_below`` of
the best; every ``full_search_interval`` decides, and whenever the pruned search would leave every
request at k = 0, it searches them all.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Protocol

import numpy as np

from specsched.policies.acceptance_stages import staged_powers, staged_rows, staged_survival, stages_of
from specsched.policies.base import BatchView
from specsched.policies.cost_model import CostModels
from specsched.policies.fixed import step_proposer
from specsched.policies.goodput_search import BatchProblem
from specsched.policies.goodput_single import SingleProblem
from specsched.policies.goodput_small import SmallProblem

__all__ = ["SearchScope"]

_REQUEST_FIELDS = attrgetter("acceptance", "acceptance_std", "context_len", "max_k", "last_k")


class ScopeSettings(Protocol):
    """The options of :class:`~specsched.policies.goodput.GoodputConfig` a search reads."""

    max_k: int
    max_iters: int
    scorer_margin: float
    optimism: float
    staged_acceptance: bool
    prune_below: float
    full_search_interval: int
    plain_search_max_batch: int


class SearchScope:
    """Builds a decide's search and keeps the pruning state between decides (module docstring)."""

    def __init__(self, config: ScopeSettings) -> None:
        self.config = config
        self._num_decides = 0  # the policy's decide count at the last problem()
        self._contenders: set[str] | None = None  # scorers the next decides search (None: every one)
        self._scorer_set: list[str] | None = None  # the scorers of the last full search
        self.last_full = 0  # decide count of the last full search
        self._staged_memo: tuple | None = None  # (decide count, view, as lists, survival): staged_acceptance

    def problem(self, view: BatchView, costs: CostModels, scorers: list[str], num_decides: int):
        """The decide's search over the contending scorers (module docstring), or over every scorer:
        on a full search's turn, when a scorer appeared or when the pruned search leaves every request
        at k = 0 (a plain decode step picks among every scorer). ``num_decides``: the policy's decide
        count, this decide's included. Returns the problem, the requests' last k, the posterior sds
        and the scorers searched."""
        cfg = self.config
        self._num_decides = num_decides
        kept = self._contenders
        if (
            cfg.prune_below > 0
            and kept is not None
            and self._num_decides - self.last_full < cfg.full_search_interval
            and self._scorer_set == scorers
        ):
            pruned = [s for s in scorers if s in kept]
            if 0 < len(pruned) < len(scorers):
                prob, last_k, spreads = self.search(view, costs, pruned)
                best = max(range(len(pruned)), key=prob.best_goodput.__getitem__)
                if any(prob.as_list(prob.best_k[best])):  # else a plain decode: every scorer competes
                    return prob, last_k, spreads, pruned
        prob, last_k, spreads = self.search(view, costs, scorers)
        self.last_full, self._scorer_set = self._num_decides, scorers
        best = max(prob.best_goodput)
        self._contenders = {s for s, g in zip(scorers, prob.best_goodput) if g >= cfg.prune_below * best}
        return prob, last_k, spreads, scorers

    def search(self, view: BatchView, costs: CostModels, scorers: list[str]):
        """The step's search: :class:`SingleProblem` (plain Python) at batch 1, :class:`SmallProblem`
        up to ``plain_search_max_batch``, else :class:`BatchProblem` (numpy); all decide alike. Also
        returns the requests' last k (a list, or ``[B]`` int for numpy) and the posterior sds of those
        that could draft."""
        reqs, cfg = view.requests, self.config
        proposer = step_proposer(view)
        if len(reqs) == 1:
            r = reqs[0]
            cap = max(min(r.max_k, cfg.max_k), 0)
            prob = SingleProblem(
                costs, scorers, proposer, r.acceptance, r.acceptance_std, r.context_len, cap, cfg.optimism,
                survival=self._staged_survival(view) if cfg.staged_acceptance else None,
            )  # fmt: skip
            return prob, [r.last_k], [r.acceptance_std] if r.max_k > 0 else []
        accs, stds, ctxs, max_k, lasts = zip(*map(_REQUEST_FIELDS, reqs))  # one pass over the views
        mean = np.array(accs, dtype=np.float64)  # [B]
        std = np.array(stds, dtype=np.float64)  # [B]
        ctx = np.array(ctxs, dtype=np.int64)  # [B]
        cap = np.array(max_k, dtype=np.int64)  # [B]
        np.minimum(cap, cfg.max_k, out=cap)
        np.maximum(cap, 0, out=cap)
        is_small = len(reqs) <= cfg.plain_search_max_batch
        staged = self._staged_powers(view, as_lists=is_small) if cfg.staged_acceptance else None
        spread = [sd for sd, m in zip(stds, max_k) if m > 0]
        if is_small:
            prob = SmallProblem(
                costs, scorers, proposer, mean, std, ctx, cap, cfg.max_iters, cfg.scorer_margin, cfg.optimism,
                powers=staged,
            )  # fmt: skip
            return prob, list(lasts), spread
        last = np.array(lasts, dtype=np.int64)  # [B]
        prob = BatchProblem(
            costs, scorers, proposer, mean, std, ctx, cap, cfg.max_iters, cfg.scorer_margin, cfg.optimism,
            powers=staged,
        )  # fmt: skip
        return prob, last, spread

    def _staged_survival(self, view: BatchView) -> list[float] | None:
        """:meth:`_staged_powers` of a batch of one request, in plain Python."""
        if view.acceptance is None:
            return None
        r = view.requests[0]
        m1, _, m2, s2 = stages_of(view.acceptance).mean_std(r.request_id, r.proposer)
        return staged_survival(m1, m2, s2, max(self.config.max_k, 1))

    def _staged_powers(self, view: BatchView, as_lists: bool = False) -> np.ndarray | list | None:
        """``[B, max_k]`` survival of each request's drafts under its two acceptance rates
        (``staged_acceptance``), or None when the view carries no estimator; ``as_lists``: the same
        numbers as Python lists of rows (:func:`staged_rows`, for the small-batch search)."""
        if view.acceptance is None:
            return None
        memo = self._staged_memo  # a pruned search and then a full one in one decide read them once
        if memo is not None and memo[0] == self._num_decides and memo[1] is view and memo[2] == as_lists:
            return memo[3]
        stages = stages_of(view.acceptance)
        num = max(self.config.max_k, 1)
        reqs = view.requests
        by: dict[str, list[int]] = {}
        for i, r in enumerate(reqs):
            by.setdefault(r.proposer, []).append(i)
        out: np.ndarray | list = [None] * len(reqs) if as_lists else np.empty((len(reqs), num))
        for proposer, idx in by.items():
            ids = [reqs[i].request_id for i in idx]
            if as_lists:
                for i, row in zip(idx, staged_rows(stages, ids, proposer, num)):
                    out[i] = row
            else:
                m1, _, m2, s2 = stages.mean_std_many(ids, proposer)
                out[idx] = staged_powers(m1, m2, s2, num)
        self._staged_memo = (self._num_decides, view, as_lists, out)
        return out
