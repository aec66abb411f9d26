"""Proposers by their config names (``proposer=...``)."""

from __future__ import annotations

from specsched.engine.config import SpecConfig
from specsched.models.llama import KVCache, LlamaForCausalLM
from specsched.proposers.base import Proposer

PROPOSER_NAMES = ("none", "ngram", "draft", "synthetic")


def check_proposer_name(name: str) -> None:
    if name not in PROPOSER_NAMES:
        raise ValueError(f"unknown proposer {name!r}; known: {', '.join(PROPOSER_NAMES)}")


def build_proposers(
    spec: SpecConfig,
    target: LlamaForCausalLM,
    num_blocks: int,
    block_size: int,
    draft_model: LlamaForCausalLM | None = None,
    target_kv: KVCache | None = None,
) -> dict[str, Proposer]:
    """The configured proposer plus the always-available cheap ones (``none``, ``ngram``), so a
    request may pick any of them through ``spec.proposer``. ``target_kv``: the target's cache, which a
    self-draft with ``draft.shared_kv`` reads and writes for its layers (else it gets its own)."""
    from specsched.proposers.ngram import NgramProposer
    from specsched.proposers.none import NoProposer

    check_proposer_name(spec.proposer)
    device = target.lm_head.weight.device
    out: dict[str, Proposer] = {"none": NoProposer(device), "ngram": NgramProposer(spec.ngram, device)}
    if spec.proposer == "draft":
        from specsched.proposers.draft import DraftModelProposer

        if draft_model is None:  # self-speculation: the target's first layers + its head
            n = min(spec.draft.num_layers, target.cfg.num_layers)
            if spec.draft.shared_kv and target_kv is not None:
                out["draft"] = DraftModelProposer(target, target_kv[:n], block_size, n, is_shared_kv=True)
            else:
                kv = target.allocate_kv_cache(num_blocks, block_size, n)
                out["draft"] = DraftModelProposer(target, kv, block_size, n)
        else:
            if draft_model.cfg.vocab_size != target.cfg.vocab_size:
                raise ValueError(
                    f"draft vocab {draft_model.cfg.vocab_size} != target vocab {target.cfg.vocab_size}"
                )
            out["draft"] = DraftModelProposer(
                draft_model, draft_model.allocate_kv_cache(num_blocks, block_size), block_size
            )
    elif spec.proposer == "synthetic":
        from specsched.proposers.synthetic import SyntheticProposer, load_oracle

        oracle = load_oracle(spec.synthetic_oracle) if spec.synthetic_oracle else None
        out["synthetic"] = SyntheticProposer(target, spec.synthetic_acceptance, block_size, oracle=oracle)
    return out
