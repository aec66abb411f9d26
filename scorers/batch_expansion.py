"""Batch-expansion scorer: each request becomes k_i + 1 single-query rows sharing its block table.

Row j of request i attends to its prefix plus drafts[:j], so every row is a plain decode row and
the captured decode CUDA graphs serve it (GPU path). Cost: the prefix KV is read k_i + 1 times and
rows grow as sum(k_i + 1). Without graphs (CPU) it runs eagerly through the same model forward.
"""

from __future__ import annotations

from specsched.scorers.eager import EagerScorer


class BatchExpansionScorer(EagerScorer):
    name = "batch_expansion"
    is_expanded = True
