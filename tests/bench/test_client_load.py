"""bench/client_load.py on loopback: a scripted daemon streams to real AsyncClients in spawned load
processes, and every process reports the chunks it read, their CPU cost and their latency."""

from __future__ import annotations

import math

import pytest

from specsched.bench.client_load import main, measure


@pytest.mark.parametrize("layout", ["per-client", "one-socket"])
def test_every_load_process_reads_the_stream_and_times_it(layout):
    rows = measure(procs=2, clients=3, step_ms=5.0, tokens=8, seconds=1.0, layout=layout)
    assert len(rows) == 2
    for row in rows:
        assert row["layout"] == layout
        # 3 streams, a chunk every 5 ms each: ~600 a second; a loaded CI box reads fewer, never none
        assert 50 < row["chunks_per_s"] < 700
        assert row["cpu_us"] > 0 and 0 < row["core_share"] < 2
        assert 0 < row["p50_ms"] <= row["p99_ms"] < 1000 and not math.isnan(row["p99_ms"])


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        main(["--procs", "0"])
