"""``stats`` reports the Triton variants built before listening and after: on CPU (torch kernels,
nothing compiled) a served request leaves the after-start-up count at 0."""

from __future__ import annotations

from specsched.client import Client


def test_stats_count_compiles_after_start_and_a_request_adds_none(tiny_daemon):
    with Client(tiny_daemon.endpoint, timeout_s=60) as c:
        before = c.stats()
        done = c.generate(prompt_ids=[5, 6, 7, 5, 6, 7, 5], max_tokens=12)
        after = c.stats()
    assert done.usage.completion_tokens > 0
    assert before.num_compiles_after_start == 0 and after.num_compiles_after_start == 0
    assert after.num_kernels_built_at_start == before.num_kernels_built_at_start == 0
