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


def test_from_log_counts_a_request_joining_at_its_first_step(tmp_path):
    from specsched.bench.join_view import from_log
    from specsched.daemon.log import LogConfig, LogWriter
    from specsched.engine.records import StepRecord, StepRequestRecord

    batches = [["a", "b"], ["a", "b"], ["a", "c"], ["d", "e"], ["d", "e", "f"]]  # joining: 2, 0, 1, 2, 1
    path = str(tmp_path / "v.sqlite")
    with LogWriter(LogConfig(path=path, flush_interval_s=0.05)) as log:
        log.start_run({"policy": {"name": "x"}}, model="hand", device="cpu", version="test")
        for step, ids in enumerate(batches):
            reqs = [StepRequestRecord(i, 10, 1, 1, "1") for i in ids]
            host = {"view": 0.1 * (step + 1)}
            log.write_step(StepRecord(step, "decode", 1.0, len(ids), 4, "mqa", "x", "ngram", total_ms=2.0,
                                      host_ms=host, requests=reqs))  # fmt: skip
    views = from_log(path, 2)
    assert {j: [round(v, 3) for v in vs] for j, vs in views.items()} == {2: [0.1, 0.4], 0: [0.2], 1: [0.3]}
    assert dict(from_log(path, 3)) == {1: [0.5]}
