"""The same-output check of ``bench=serve``: the baseline's outputs per prompt as references, and the
share of a pass's requests whose greedy output equals them; a pass's table row."""

from __future__ import annotations

from specsched.bench.serve_results import PassResult, summarize_many


def same_output_share(res: PassResult, reference: dict[int, list[int]] | None) -> float | None:
    """Share of the pass's full-length requests whose token ids equal the reference's for the same
    prompt; a timed pass's cut-short first requests (``staggered``) are left out."""
    if reference is None:
        return None
    ok = [r for r in res.requests if r.error is None and not r.staggered and r.prompt_index in reference]
    if not ok:
        return None
    return sum(r.token_ids == reference[r.prompt_index] for r in ok) / len(ok)


def add_references(reference_n: dict[int, list[int]], res: PassResult) -> None:
    """The first full-length output per prompt of the pass (the baseline's pass 1 at one N) becomes
    that prompt's reference; cut-short first requests (``staggered``) and failed ones never do."""
    for r in res.requests:
        if r.error is None and not r.staggered:
            reference_n.setdefault(r.prompt_index, r.token_ids)


def pass_row(head: dict, parts: list[PassResult], reference: dict[int, list[int]] | None) -> dict:
    """A table row: ``head`` (config, kind, concurrency, pass) and the cells of the pass made of
    ``parts`` (one loop, or its share of every round's), its same-output share and slowest TTFT."""
    every = PassResult(0.0, [r for part in parts for r in part.requests])
    ttfts = [r.ttft_s for r in every.requests if r.ttft_s is not None]
    return {**head, **summarize_many(parts), "same_output": same_output_share(every, reference),
            "ttft_max_s": max(ttfts, default=None)}  # fmt: skip
