"""Synthetic-acceptance proposer — for benchmarks only, labelled ``is_synthetic`` everywhere.

Random-weight models (the ``llama2-7b`` timing preset) have no meaningful draft, so to time the
engine at a chosen acceptance rate ``a`` this proposer proposes the *target's own greedy
continuation* with per-token probability ``a`` and a wrong token otherwise. The continuation comes
from an oracle: the benchmark first runs the prompts without speculation and registers each
output with :meth:`SyntheticProposer.set_oracle`. Greedy verification is still the real one, so
the output stays exactly the target's; only the acceptance is synthetic. When ``draft`` is given,
the real draft model also runs (its tokens discarded) so the step pays the real proposal cost.
"""

from __future__ import annotations

import random

from specsched.engine.request import Request
from specsched.models.llama import LlamaForCausalLM
from specsched.proposers.base import Proposals, Proposer, ProposerPeek


class SyntheticProposer(Proposer):
    name = "synthetic"
    is_synthetic = True

    def __init__(
        self,
        target: LlamaForCausalLM,
        acceptance: float,
        block_size: int,
        seed: int = 0,
        draft: Proposer | None = None,
    ) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"synthetic acceptance must be in [0, 1], got {acceptance}")
        self.acceptance, self.vocab = acceptance, target.cfg.vocab_size
        self.device = target.lm_head.weight.device
        self.draft = draft
        self.rng = random.Random(seed)
        self._oracle: dict[tuple[int, ...], list[int]] = {}

    def set_oracle(self, prompt_ids: list[int], continuation: list[int]) -> None:
        """Register the target's greedy continuation of ``prompt_ids``."""
        self._oracle[tuple(prompt_ids)] = list(continuation)

    def _truth(self, req: Request, k: int) -> list[int]:
        cont = self._oracle.get(tuple(req.prompt_ids), [])
        n = req.num_output_tokens
        if cont[:n] != req.output_ids:  # off the oracle's path (sampled request, other prompt)
            return []
        return cont[n : n + k]

    def propose(self, batch: list[Request], k: list[int]) -> Proposals:
        if self.draft is not None:  # pay the real proposal cost; its tokens are discarded
            self.draft.propose(batch, k)
        drafts = []
        for req, ki in zip(batch, k):
            truth = self._truth(req, ki)
            d = [
                t
                if self.rng.random() < self.acceptance
                else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                for t in truth
            ]
            drafts.append(d)
        out = Proposals.from_lists(drafts)  # on the host, like the other proposers
        out.is_synthetic = True
        return out

    def on_commit(self, batch: list[Request]) -> None:
        if self.draft is not None:
            self.draft.on_commit(batch)

    def peek(self, batch: list[Request]) -> ProposerPeek:
        return ProposerPeek(max_k=[len(self._truth(r, 1 << 20)) for r in batch])


def attach_oracle(proposer: Proposer, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    if not isinstance(proposer, SyntheticProposer):
        raise TypeError(f"expected the synthetic proposer, got {type(proposer).__name__}")
    for p, o in zip(prompts, outputs):
        proposer.set_oracle(p, o)
