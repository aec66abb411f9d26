"""N-gram proposer: prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding").

The drafts for a request are the tokens that followed an earlier occurrence of its current
suffix: for n from ``max_n`` down to ``min_n``, find the most recent earlier position where the
last n tokens occurred, and propose what came after it. No probabilities: verification treats
the drafts as one-hot q.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specsched.engine.config import NgramConfig
from specsched.engine.request import Request
from specsched.proposers.base import Proposals, Proposer, ProposerPeek


def _check_n(min_n: int, max_n: int) -> None:
    if not (1 <= min_n <= max_n):
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")


def ngram_match(tokens: np.ndarray, min_n: int, max_n: int) -> int | None:
    """Start of the continuation after the best earlier match of the suffix, or None.

    Best = the longest n in [min_n, max_n] whose last-n-token suffix occurred earlier (the
    occurrence may overlap the suffix but not be it), the most recent such occurrence. The
    continuation is ``tokens[start:]`` (at least one token).
    """
    _check_n(min_n, max_n)
    last = len(tokens) - 1
    max_n = min(max_n, last)  # an earlier occurrence of length n ends at <= last - 1
    if max_n < min_n:
        return None
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # [C] candidate occurrence ends, ascending
    if ends.size == 0:
        return None
    offsets = np.arange(max_n)  # [n]
    pos = ends[:, None] - offsets  # [C, n] position i before each candidate end
    same = tokens[np.maximum(pos, 0)] == tokens[last - offsets]  # [C, n] matches the suffix there
    same &= pos >= 0
    match_len = same.cumprod(axis=1).sum(axis=1)  # [C] common suffix length (leading run), <= max_n
    best = int(match_len.max())
    if best < min_n:
        return None
    return int(ends[np.flatnonzero(match_len == best)[-1]]) + 1


def ngram_lookup(tokens: Sequence[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the best earlier match of the suffix (see
    :func:`ngram_match`); ``[]`` when nothing matches or ``k == 0``."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    _check_n(min_n, max_n)
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if k == 0:
        return []
    start = ngram_match(arr, min_n, max_n)
    return [] if start is None else arr[start : start + k].tolist()


_ZIP_FROM = 16  # index this many new positions or more by zipping columns, fewer in a loop
LAZY_MAX = 16  # a match compares at most this many unindexed end positions directly (NgramIndex.match)
MAX_FINISHED = 256  # finished requests' entries kept for freeing off the critical path, at most


class NgramIndex:
    """The most recent end position of every n-gram (``min_n <= n <= max_n``) of a growing token
    sequence, for :func:`ngram_match` in O(max_n - min_n) dictionary lookups per step instead of a
    scan of the sequence. An n-gram is keyed by the tuple of its tokens (Python ints: on the few
    tokens a decode step adds, tuple slices cost a fraction of numpy's per-call overhead), every n in
    one dict (tuples of different lengths never compare equal).

    ``extend(tokens, stop)`` indexes the n-grams ending at positions ``num_indexed .. stop - 1`` (a
    later end overwrites an earlier one: the most recent wins); ``match(tokens)`` is
    :func:`ngram_match` over ``tokens``: the dictionary for the indexed ends, a direct comparison for
    the few end positions after them (up to the one before the last token), which stay unindexed
    until the next ``extend``.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        _check_n(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> its most recent end position
        self.num_indexed = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: Sequence[int], stop: int) -> None:
        start = self.num_indexed
        if start >= stop:
            return
        self.num_indexed = stop
        if stop - start < _ZIP_FROM:  # the few a decode step adds
            self._extend_few(tokens, start, stop)
            return
        ends = self.ends
        for n in range(self.min_n, self.max_n + 1):  # the n-gram ending at e is tokens[e - n + 1 : e + 1]
            lo = max(start, n - 1)
            if stop - lo >= _ZIP_FROM:  # many (a prompt): its n columns zipped, in C
                cols = [tokens[lo - n + 1 + j : stop - n + 1 + j] for j in range(n)]
                ends.update(zip(zip(*cols), range(lo, stop)))
            else:  # the stretch past n - 1 is short
                for e in range(lo, stop):
                    ends[tuple(tokens[e - n + 1 : e + 1])] = e

    def _extend_few(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """:meth:`extend` for a few end positions: one tuple of the longest n-gram per end, the shorter
        ones sliced from it (a tuple slice is one allocation; a list slice made a tuple is two)."""
        min_n, max_n = self.min_n, self.max_n
        ends = self.ends
        for e in range(max(start, min_n - 1), stop):
            top = max_n if e >= max_n - 1 else e + 1  # the longest n-gram ending at e
            longest = tuple(tokens[e - top + 1 : e + 1])
            for n in range(min_n, top + 1):
                ends[longest[top - n :]] = e

    def match(self, tokens: Sequence[int]) -> int | None:  # the sequence so far
        """:func:`ngram_match` over ``tokens``. The end positions from ``num_indexed`` to the one before
        the last token (at most ``LAZY_MAX``: the tokens a decode step committed) are compared with the
        suffix directly instead of indexed: they are more recent than every indexed end, so for each n
        the most recent of them that matches wins over the dictionary's. Indexing them is left to the
        next :meth:`extend` (the proposer's ``on_scoring``, while the GPU scores): on the critical path
        a match then builds one tuple, not ``max_n`` per new position (at batch 64 the indexing was
        ~55 % of the n-gram peek's host time, 2026-12-07)."""
        last = len(tokens) - 1
        if last < 1:
            return None
        lo = self.num_indexed
        if lo > last:  # indexed past the suffix (the tokens did not grow): scan
            return ngram_match(np.asarray(tokens, dtype=np.int64), self.min_n, self.max_n)
        if last - lo > LAZY_MAX:  # a long stretch (no on_scoring on this path): index it in bulk
            self.extend(tokens, last)
            lo = last
        top = min(self.max_n, last)
        tail = tokens[last]
        # the unindexed ends e in [lo, last) whose token equals the last one, most recent first, with
        # the length of the suffix they share (capped at top, and at e + 1: the sequence's start)
        found: list[tuple[int, int]] = []
        for e in range(last - 1, lo - 1, -1):
            if tokens[e] == tail:
                n, cap = 1, min(top, e + 1)
                while n < cap and tokens[e - n] == tokens[last - n]:
                    n += 1
                found.append((e, n))
        get = self.ends.get
        suffix = tuple(tokens[last - top + 1 :])  # the longest suffix tried; shorter ones sliced from it
        for n in range(top, self.min_n - 1, -1):
            for e, length in found:  # most recent first: the first that shares n tokens wins
                if length >= n:
                    return e + 1
            e = get(suffix[top - n :])
            if e is not None:
                return e + 1
        return None


@dataclass(slots=True)
class _CachedTokens:
    owner: int  # id() of the Request whose tokens these are
    num_prompt: int
    tokens: list[int]  # a copy of the request's prompt + output, extended by appends
    index: NgramIndex
    match_at: int = -1  # len(tokens) when match_start was found (peek), -1: none yet
    match_start: int | None = None  # ngram_match over the first match_at tokens


class NgramProposer(Proposer):
    """Prompt lookup over each request's prompt + output (``req.token_ids``).

    Keeps a copy of each request's tokens, extended by appends (tokens only grow while a request
    runs), with its :class:`NgramIndex` (each step indexes only the new tokens and looks the suffix
    up: no scan of the sequence). Both are rebuilt when the Request object, its prompt length, a
    shorter total length or the last cached token disagree with the copy, and dropped in
    :meth:`on_finish`. The match :meth:`peek` finds is kept with it, so :meth:`propose` on the same
    tokens (the same step) does not search again.
    """

    name = "ngram"

    def __init__(self, cfg: NgramConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self._cache: dict[str, _CachedTokens] = {}  # request_id -> its tokens
        # finished requests' entries, freed in the next on_scoring / on_prefill (while the GPU runs):
        # freeing an index of a few thousand n-gram tuples took ~40 µs on the dev CPU, on the commit
        self._finished: list[_CachedTokens] = []

    def _entry(self, req: Request) -> _CachedTokens:
        """The request's cache entry, its tokens brought up to ``req.token_ids`` (rebuilt when they
        disagree with the copy); its match is current when ``match_at == len(tokens)``."""
        prompt, out = req.prompt_ids, req.output_ids
        num_prompt = len(prompt)
        c = self._cache.get(req.request_id)
        if c is not None and c.owner == id(req) and c.num_prompt == num_prompt:
            tokens = c.tokens
            have = len(tokens) - num_prompt  # output tokens copied so far
            if 0 <= have <= len(out) and (have == 0 or tokens[-1] == out[have - 1]):
                if have < len(out):
                    tokens += out[have:]
                return c
        # first sight, or the tokens disagree with the copy: rebuild
        c = _CachedTokens(id(req), num_prompt, prompt + out, NgramIndex(self.cfg.min_n, self.cfg.max_n))
        self._cache[req.request_id] = c
        return c

    def peek(self, batch: list[Request]) -> ProposerPeek:
        """``max_k[i]``: how many tokens follow request i's best match (0 when none)."""
        max_k, entry = [], self._entry
        for req in batch:  # the match, cached per token count (propose reuses it), found at most once
            c = entry(req)
            n = len(c.tokens)
            if c.match_at != n:
                c.match_start, c.match_at = c.index.match(c.tokens), n
            start = c.match_start
            max_k.append(0 if start is None else n - start)
        return ProposerPeek(max_k=max_k)

    def propose(self, batch: list[Request], k: list[int]) -> Proposals:
        """Request i's drafts: ``ngram_lookup(req.token_ids, min_n, max_n, k[i])`` (may be fewer
        than ``k[i]``; ``num_draft`` holds the actual count)."""
        if len(k) != len(batch):
            raise ValueError(f"k has {len(k)} entries for a batch of {len(batch)} requests")
        if k and min(k) < 0:
            raise ValueError(f"k must be >= 0 for every request, got {k}")
        drafts, entry = [], self._entry
        for req, ki in zip(batch, k, strict=True):
            if ki <= 0:
                drafts.append([])
                continue
            c = entry(req)  # the match peek found on these tokens (else found here)
            tokens = c.tokens
            if c.match_at != len(tokens):
                c.match_start, c.match_at = c.index.match(tokens), len(tokens)
            start = c.match_start
            drafts.append([] if start is None else tokens[start : start + ki])
        return Proposals.from_lists(drafts)  # host tensors: scorers and verify read them there

    def on_scoring(self, batch: list[Request]) -> None:
        """Index the n-grams that end at each request's last token now: their tokens are all known
        before the commit, so the next :meth:`peek` indexes only those ending at the tokens this step
        commits (on CUDA this runs while the GPU scores: off the critical path). Finished requests'
        entries are freed here too."""
        self._finished.clear()
        cache = self._cache
        for req in batch:
            c = cache.get(req.request_id)
            if c is not None and c.owner == id(req):
                n = len(c.tokens)
                if n == len(req.prompt_ids) + len(req.output_ids) and c.index.num_indexed < n:
                    c.index.extend(c.tokens, n)

    def on_prefill(self, batch: list[Request]) -> None:
        """Copy each request's tokens and index the n-grams that end before its last one now (while
        the GPU prefills), so that its first :meth:`peek` indexes only the one or two end positions
        its prefill adds: the prompt's n-grams are the bulk of a request's index, and a first peek
        building them put them on a decode step's critical path. (Not up to the last token: a
        request prefilled again after a preemption gets no new token, and an index past the
        suffix would send its next match to the full scan.)"""
        self._finished.clear()
        for req in batch:
            c = self._entry(req)
            stop = len(c.tokens) - 1
            if c.index.num_indexed < stop:
                c.index.extend(c.tokens, stop)

    def on_finish(self, request: Request) -> None:
        """Drop the request's entry; it is freed in the next :meth:`on_scoring` or :meth:`on_prefill`
        (off the commit's critical path on CUDA), or at once past ``MAX_FINISHED`` waiting."""
        c = self._cache.pop(request.request_id, None)
        if c is not None:
            self._finished.append(c)
            if len(self._finished) > MAX_FINISHED:  # no scoring or prefill for a while (the CPU path)
                self._finished.clear()
