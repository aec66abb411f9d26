"""The real daemon freezes its start-up heap out of the GC's full passes before it listens, and serves."""

from __future__ import annotations

import re

from specsched.client.sync_client import Client


def test_daemon_freezes_the_start_up_heap_before_listening(start_cli_daemon):
    d = start_cli_daemon()
    with Client(d.endpoint, timeout_s=60) as c:
        assert c.generate(prompt_ids=[5, 6, 7, 8], max_tokens=4).token_ids  # serving after the freeze
    out = d.output()
    m = re.search(r"(\d+) start-up objects frozen out of the GC's passes", out)
    assert m, out[-2000:]
    assert int(m.group(1)) > 10_000  # torch, the model, the imports
    assert out.index("start-up objects frozen") < out.index("specsched daemon listening on ")
