"""MQA scorer: one varlen row per request with q_len = k_i + 1 (eager).

The prefix KV of each request is read once; ragged k (n-gram gives 0 or k) is natural. Eager, it
pays the CPU launch overhead of every kernel (see DESIGN.md, "why two scorers").
"""

from __future__ import annotations

from specsched.scorers.eager import EagerScorer


class MQAScorer(EagerScorer):
    name = "mqa"
    is_expanded = False
