"""bench/join_view.py on a small closed loop: every request is served, decode steps at the full batch
are grouped by how many requests join them, and the first peek of each finds its prompt indexed."""

from __future__ import annotations

from specsched.bench.join_view import run, summarize


def test_join_view_groups_full_batch_steps_by_joining_requests():
    records = run(batch=4, prompt_len=60, num_per_slot=2)
    decoded = {q.request_id for r in records if r.kind == "decode" for q in r.requests}
    assert decoded == {f"j{i}" for i in range(8)}
    views, prefill = summarize(records, 4)
    assert prefill and all(ms > 0 for ms in prefill)
    assert 0 in views and any(j > 0 for j in views)  # steady steps and steps that new requests join
    full = [r for r in records if r.kind == "decode" and r.batch_size == 4]
    assert sum(map(len, views.values())) == len(full)
    assert all(ms > 0 for v in views.values() for ms in v)
