"""Carrying a plan to a later step's batch (:func:`carry_plan`): the engine's planner
(:mod:`specsched.engine.planning`) runs a plan decided ahead, or an earlier one while the decide
budget says a new one is not due, on a batch whose requests, offers and estimates moved since."""

from __future__ import annotations

import heapq
from bisect import bisect_left
from dataclasses import replace

from specsched.policies.base import BatchView, Plan

__all__ = ["carry_plan", "intent_k"]


def intent_k(plan: Plan) -> list[int]:
    """Each request's k had it been offered every draft: the plan's ``info["k_intent"]`` where it has
    one for every request (goodput's, when an offer was cut or the plan fit a graph), else its k."""
    intent = plan.info.get("k_intent")
    return intent if intent is not None and len(intent) == len(plan.k) else plan.k


def carry_plan(
    ids: list[str], plan: Plan, view: BatchView, max_joined: float | None, caps: dict[str, int] | None = None
) -> Plan | None:
    """``plan`` (decided for requests ``ids``; ``caps``: their max_k in the view it was decided on) for
    the batch of ``view``; None when no request of the batch was in the plan, or (``max_joined`` not None)
    more than ``max_joined`` of it (a share of the batch, at least one request) joined since. Every k is
    capped by its request's ``max_k`` now. A joined request, and a *reopened* one (planned at k = 0
    because it could not draft then: cap 0 in ``caps``, and it can now: an n-gram match came since), takes
    the planned k of the kept request of the same proposer, able to draft at the decide, whose acceptance
    estimate is nearest its own (``view``'s estimates: a fresh request's is its proposer's pooled prior),
    so a carried plan drafts for it about as the policy drafts for requests like it. A plan whose
    ``info["k_intent"]`` gives each request's k had it been offered every draft (goodput's, when the
    decide saw a request's offer cut short or the plan fit a graph) carries that instead of its k,
    capped as above: an offer that
    grew since is taken (replaying the 2026-12-06 H100 serve log of k = 8, a plan decided on the step's
    offers and carried by its k for 6 steps drafted 2-5 % fewer tokens per request-step than deciding
    every step at N = 4-64, by its intent 0-0.7 %); reopening does not apply. With the intent, a plan's
    ``info["token_budget"]`` (goodput's on a graph scorer: the bucket the plan runs in) bounds the
    carry's tokens: past it, the least valuable drafts above each kept request's planned k (capped by
    its offer) go, while a request the plan held at its offer keeps its intent (docs/policies.md,
    *token budget*). A carry that leaves every k at 0 runs on the plan's ``info["k0_scorer"]`` when it
    names one of the run's scorers (the policy's scorer for a plain decode step: the decode graph, not
    the MQA graph the speculative plan chose). The plan's ``info`` is copied with ``num_joined`` /
    ``num_left`` / ``num_reopened`` added (the original is not changed)."""
    old_k, caps, views = plan.k, caps or {}, view.requests
    decided_caps = caps
    intent = plan.info.get("k_intent")
    is_intent = intent is not None and len(intent) == len(old_k)
    if is_intent:  # the k each would take if offered more
        old_k, caps = intent, {}  # a request held at its cap carries its intent: no reopening
    if ids and len(ids) == len(views) and ids == [v.request_id for v in views]:  # the same batch
        k, num_reopened = _carry_same(old_k, views, caps)
        num_joined = num_left = 0
    else:
        index = {rid: i for i, rid in enumerate(ids)}
        kept = [(v, old_k[index[v.request_id]]) for v in views if v.request_id in index]
        if not kept:
            return None
        num_joined = len(views) - len(kept)
        if max_joined is not None and num_joined > max(1, int(max_joined * len(views))):
            return None
        k, fill, num_reopened = [], [], 0  # fill: positions that take the nearest request's k
        for v in views:
            i = index.get(v.request_id)
            if i is None:
                fill.append(len(k))
                k.append(0)
            elif old_k[i] == 0 and v.max_k > 0 and caps.get(v.request_id, 1) == 0:  # reopened
                num_reopened += 1
                fill.append(len(k))
                k.append(0)
            else:
                ok = old_k[i]
                k.append(ok if ok < v.max_k else v.max_k)
        if fill:
            nearest = _Nearest([(u, uk) for u, uk in kept if caps.get(u.request_id, 1) > 0])
            for j in fill:
                k[j] = nearest.k(views[j])
        num_left = len(ids) - len(kept)
    budget = plan.info.get("token_budget") if is_intent else None
    if budget is not None and len(k) + sum(k) > budget:
        k = _trim_to_budget(k, _floors(ids, plan.k, decided_caps, views, k), views, budget)
    info = {**plan.info, "num_joined": num_joined, "num_left": num_left, "num_reopened": num_reopened}
    info.pop("k_intent", None)  # in the decided plan's request order; the carried k are its use
    info.pop("token_budget", None)
    info.pop("acceptance", None)  # the decided plan's posteriors: logged once, with the decide
    scorer = plan.scorer
    if not any(k) and info.get("k0_scorer") in view.scorers:  # a plain decode: the policy's scorer for one
        scorer = info["k0_scorer"]
    return replace(plan, k=k, scorer=scorer, info=info)


def _floors(ids: list[str], planned: list[int], caps: dict[str, int], views: list, k: list[int]) -> list[int]:
    """Each request's least k in a trim to the token budget (``k``: the carried intent): a kept
    request's planned k capped by its ``max_k`` now; its carried k where the plan held it at its cap
    (``caps``: the offers at the decide; an offer that grew since is taken, as without a budget) and
    for a joined request (it took a kept request's k)."""
    index = {rid: i for i, rid in enumerate(ids)}
    out = []
    for v, kk in zip(views, k):
        i = index.get(v.request_id)
        if i is None or planned[i] >= caps.get(v.request_id, planned[i] + 1):
            out.append(kk)
        else:
            out.append(min(planned[i], v.max_k, kk))
    return out


def _trim_to_budget(k: list[int], floor: list[int], views: list, budget: int) -> list[int]:
    """``k`` with drafts above ``floor`` dropped, the least valuable first (draft j of a request at
    acceptance estimate a is worth a^j, so a request keeps a prefix), until the step's tokens (B + Σ k)
    are within ``budget``, or every request is at its floor."""
    k = list(k)
    excess = len(k) + sum(k) - budget
    heap = [(views[i].acceptance ** k[i], i) for i in range(len(k)) if k[i] > floor[i]]
    heapq.heapify(heap)
    while excess > 0 and heap:
        _, i = heapq.heappop(heap)
        k[i] -= 1
        excess -= 1
        if k[i] > floor[i]:
            heapq.heappush(heap, (views[i].acceptance ** k[i], i))
    return k


class _Nearest:
    """The planned k of the request in ``able`` ((view, k) pairs) of a request's proposer whose
    acceptance estimate is nearest its own (the smaller k on a tie, and among requests of one
    estimate), capped by its ``max_k``; 0 when its proposer has none. Looked up by bisection over
    each proposer's distinct estimates (a fresh request's is its proposer's pooled prior, which many
    share)."""

    def __init__(self, able: list) -> None:
        best: dict[str, dict[float, int]] = {}
        for u, uk in able:
            by_a = best.setdefault(u.proposer, {})
            a = u.acceptance
            if uk < by_a.get(a, uk + 1):
                by_a[a] = uk
        self.tables = {}
        for name, by_a in best.items():
            accs = sorted(by_a)
            self.tables[name] = (accs, [by_a[a] for a in accs])

    def k(self, v) -> int:
        table = self.tables.get(v.proposer)
        if table is None:
            return 0
        accs, ks = table
        a = v.acceptance
        i = bisect_left(accs, a)
        near = []
        if i < len(accs):
            near.append((accs[i] - a, ks[i]))
        if i > 0:
            near.append((a - accs[i - 1], ks[i - 1]))
        k = min(near)[1]
        return k if k < v.max_k else v.max_k


def _carry_same(old_k: list[int], views: list, caps: dict[str, int]) -> tuple[list[int], int]:
    """:func:`carry_plan`'s k for the batch the plan was decided for (the usual step: nobody joined or
    left), in one pass over the requests; (k, number of reopened requests)."""
    k, reopened = [], []
    for i, (v, ok) in enumerate(zip(views, old_k)):
        m = v.max_k
        if ok == 0 and m > 0 and caps.get(v.request_id, 1) == 0:  # reopened: filled below
            reopened.append(i)
            k.append(0)
        else:
            k.append(ok if ok < m else m)
    if reopened:
        nearest = _Nearest([(u, uk) for u, uk in zip(views, old_k) if caps.get(u.request_id, 1) > 0])
        for i in reopened:
            k[i] = nearest.k(views[i])
    return k, len(reopened)
