"""Synthetic-acceptance proposer — for benchmarks only, labelled ``is_synthetic`` everywhere.

Random-weight models (the ``llama2-7b`` timing preset) have no meaningful draft, so to time the
engine at a chosen acceptance rate ``a`` this proposer proposes the *target's own greedy
continuation* with per-token probability ``a`` and a wrong token otherwise. The continuation comes
from an oracle: the benchmark first runs the prompts without speculation and registers each
output with :meth:`SyntheticProposer.set_oracle` (in process), or writes them to a JSON file that
:func:`load_oracle` reads (``proposer.synthetic_oracle=<path>``, the daemon). Greedy verification
is still the real one, so the output stays exactly the target's; only the acceptance is synthetic.
When ``draft`` is given, the real draft model also runs (its tokens discarded) so the step pays the
real proposal cost.

*Common random numbers*: whether the draft of output position p of a prompt is right is fixed by
(seed, prompt, p): a uniform u_p drawn once per position, the draft right iff u_p < a. Every config
run on the same prompts meets the same acceptance outcomes at the same positions, as with a real
draft under greedy decoding (whether its token matches is a function of the context), so two
policies compared on a cell differ by their choices, not by their luck. With one stream shared
across the runs (before 2026-12-05) the luck alone gave a 500-step window's tokens per step a 2.2 %
sd at a = 0.9 and k = 8 (3.1 % for the ratio of two windows), as much as the regret benchmark's
differences.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from specsched.engine.request import Request
from specsched.models.llama import KVCache, LlamaForCausalLM
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
        oracle: list[tuple[list[int], list[int]]] | None = None,
    ) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"synthetic acceptance must be in [0, 1], got {acceptance}")
        self.acceptance, self.vocab = acceptance, target.cfg.vocab_size
        self.device = target.lm_head.weight.device
        self.draft = draft
        self.seed = seed
        # prompt -> (continuation, u_p per position, wrong-token offset per position)
        self._oracle: dict[tuple[int, ...], tuple[list[int], list[float], list[int]]] = {}
        # request id -> [the request, its oracle entry (None: off the path), output tokens checked]
        self._paths: dict[str, list] = {}
        for prompt_ids, continuation in oracle or ():
            self.set_oracle(prompt_ids, continuation)

    def set_oracle(self, prompt_ids: list[int], continuation: list[int]) -> None:
        """Register the target's greedy continuation of ``prompt_ids`` and draw its positions'
        acceptance outcomes (module docstring: one stream per (seed, prompt), the same in every run)."""
        key = tuple(prompt_ids)
        rng = random.Random(f"specsched-synthetic/{self.seed}/{key}")  # str seeds hash the same everywhere
        n = len(continuation)
        u = [rng.random() for _ in range(n)]
        wrong = [1 + rng.randrange(self.vocab - 1) for _ in range(n)]
        self._oracle[key] = (list(continuation), u, wrong)

    def _on_path(self, req: Request) -> tuple[list[int], list[float], list[int]] | None:
        """The oracle's entry for ``req``'s prompt; None off the oracle's path (a sampled request,
        another prompt). The prompt is looked up once per request and only the output tokens new
        since the last call are compared (every peek and propose asks: hashing the prompt and
        comparing the whole output each time was 0.4 ms a step at batch 64, H100 2026-12-05, a cost
        the non-speculative baseline does not pay)."""
        entry = self._paths.get(req.request_id)
        if entry is None or entry[0] is not req:
            entry = self._paths[req.request_id] = [req, self._oracle.get(tuple(req.prompt_ids)), 0]
        found, checked = entry[1], entry[2]
        if found is None:
            return None
        out = req.output_ids
        n = len(out)
        if n < checked:  # fewer outputs than seen (not done by the engine): check them all again
            checked = 0
        if found[0][checked:n] != out[checked:n]:
            entry[1] = None  # off the path for good: an output token differs from the oracle's
            return None
        entry[2] = n
        return found

    def propose(self, batch: list[Request], k: list[int]) -> Proposals:
        if self.draft is not None:  # pay the real proposal cost; its tokens are discarded
            self.draft.propose(batch, k)
        drafts, a, vocab = [], self.acceptance, self.vocab
        for req, ki in zip(batch, k):
            found, n = self._on_path(req), req.num_output_tokens
            truth = []
            if found:
                cont, u, wrong = found
                truth = [
                    t if u[n + i] < a else (t + wrong[n + i]) % vocab for i, t in enumerate(cont[n : n + ki])
                ]
            drafts.append(truth)
        out = Proposals.from_lists(drafts)  # on the host, like the other proposers
        out.is_synthetic = True
        return out

    def on_commit(self, batch: list[Request]) -> None:
        if self.draft is not None:
            self.draft.on_commit(batch)

    def draft_model(self) -> tuple[LlamaForCausalLM, KVCache] | None:
        return None if self.draft is None else self.draft.draft_model()  # the real draft it pays for

    def on_finish(self, request: Request) -> None:
        self._paths.pop(request.request_id, None)
        if self.draft is not None:
            self.draft.on_finish(request)

    def peek(self, batch: list[Request]) -> ProposerPeek:
        on_path = self._on_path
        return ProposerPeek(
            max_k=[max(0, len(found[0]) - r.num_output_tokens) if (found := on_path(r)) else 0 for r in batch]
        )


def attach_oracle(proposer: Proposer, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    if not isinstance(proposer, SyntheticProposer):
        raise TypeError(f"expected the synthetic proposer, got {type(proposer).__name__}")
    for p, o in zip(prompts, outputs):
        proposer.set_oracle(p, o)


def _id_list(value: object, where: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise ValueError(f"{where} must be a list of non-negative int token ids, got {value!r:.80}")
    return value


def load_oracle(path: str | Path) -> list[tuple[list[int], list[int]]]:
    """The ``(prompt_ids, continuation)`` pairs of an oracle file, as bench/serve.py's
    ``write_oracle`` writes it: ``{"prompts": [[ids]], "outputs": [[ids]]}`` (same lengths).
    Raises ``ValueError`` naming the file and the bad entry."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"synthetic oracle file not found: {str(p)!r}")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"synthetic oracle {str(p)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not {"prompts", "outputs"} <= data.keys():
        raise ValueError(
            f'synthetic oracle {str(p)!r} must be {{"prompts": [[ids]], "outputs": [[ids]]}}, '
            f"got {type(data).__name__} {list(data) if isinstance(data, dict) else ''}"
        )
    prompts, outputs = data["prompts"], data["outputs"]
    if not isinstance(prompts, list) or not isinstance(outputs, list):
        raise ValueError(f"synthetic oracle {str(p)!r}: 'prompts' and 'outputs' must be lists")
    if len(prompts) != len(outputs):
        raise ValueError(f"synthetic oracle {str(p)!r}: {len(prompts)} prompts but {len(outputs)} outputs")
    out: list[tuple[list[int], list[int]]] = []
    seen: dict[tuple[int, ...], list[int]] = {}
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        prompt = _id_list(prompt, f"synthetic oracle {str(p)!r}: prompts[{i}]")
        output = _id_list(output, f"synthetic oracle {str(p)!r}: outputs[{i}]")
        if not prompt:
            raise ValueError(f"synthetic oracle {str(p)!r}: prompts[{i}] is empty")
        if seen.setdefault(tuple(prompt), output) != output:
            raise ValueError(f"synthetic oracle {str(p)!r}: prompts[{i}] repeats with another output")
        out.append((prompt, output))
    return out
