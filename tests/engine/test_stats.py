"""EngineStats' tokens/s window: the running sum equals the tokens of the steps still in the window."""

from __future__ import annotations

import random

from specsched.engine import stats as stats_mod
from specsched.engine.records import StepRecord
from specsched.engine.stats import EngineStats


def test_window_running_sum_matches_the_steps_in_the_window(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stats_mod.time, "monotonic", lambda: now[0])
    st = EngineStats(window_s=1.0, started=100.0)
    rng, seen = random.Random(0), []
    for i in range(500):
        now[0] += rng.choice([0.001, 0.01, 0.1, 0.7])
        n = rng.randint(0, 9)
        seen.append((now[0], n))
        st.observe(StepRecord(i, "decode", 0.0, 1, 1, num_emitted=n))
        inside = [(t, k) for t, k in seen if t >= now[0] - 1.0]
        span = max(inside[-1][0] - inside[0][0], 1e-3)
        want = sum(k for _, k in inside) / span if len(inside) >= 2 else 0.0
        assert abs(st.tokens_per_s - want) < 1e-9
        assert abs(st.recent_tokens_per_s() - sum(k for _, k in inside) / min(1.0, now[0] - 100.0)) < 1e-9
    now[0] += 5.0  # idle: everything leaves the window
    assert st.recent_tokens_per_s() == 0.0 and st.num_tokens_out == sum(k for _, k in seen)
