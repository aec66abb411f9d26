"""Lossless verification of draft tokens: greedy matching and speculative rejection sampling.

References: Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative
Decoding" (Algorithm 1); Chen, Borgeaud, Irving, Lespiau, Sifre, Jumper 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling" (Algorithm 2).

Terms, for request i with k_i draft tokens d_0..d_{k_i-1}:
- p_j: the target distribution at draft position j (target row ``j``); q_j: the draft
  distribution d_j was sampled from (one-hot at d_j for a deterministic proposer like n-gram).
- **accepted** tokens: the longest prefix of drafts kept. Greedy: d_j == argmax p_j. Sampled:
  d_j is kept with probability min(1, p_j(d_j) / q_j(d_j)), independently, until the first reject.
- **recovered** token: at the first rejected position j, a token resampled from
  norm(max(0, p_j - q_j)) (greedy: argmax p_j). Together with acceptance this makes the emitted
  token exactly p_j-distributed. If max(0, p_j - q_j) has no mass (rounding), p_j is used.
- **bonus** token: after all k_i drafts are accepted, one token from p_{k_i} (target row k_i).
Each request therefore emits ``num_accepted + 1`` tokens per step.

Layout: request i owns target rows ``cu_num_draft[i] + i ... cu_num_draft[i+1] + i`` (k_i + 1
rows, inclusive); the row scoring draft j is at offset j, the last row is for the bonus token.
Sampled verification is vectorised over the batch with padded ``[B, max_k]`` tensors (the only
per-request loop, in :func:`verify`, draws each request's uniforms from its own generator). Greedy
verification needs only the argmax: one device op and one host copy of the argmaxes and drafts,
then a host walk over at most sum(k_i + 1) tokens (a few dozen device ops less per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsched.engine.request import SamplingParams
from specsched.kernels.pending_read import PendingRead
from specsched.kernels.sampling import SamplingTensors, logits_to_probs, sample_from_probs
from specsched.proposers.base import Proposals


def _match_bits(k: int, num_accepted: int) -> str:
    """``VerifyResult.match_bits`` of one request: "" for k = 0, else "1" per accepted draft and "0"
    when one was rejected."""
    return ("1" * num_accepted + ("0" if num_accepted < k else "")) if k else ""


_MATCH_BITS = [[_match_bits(k, a) for a in range(k + 1)] for k in range(33)]  # [k][accepted]


@dataclass
class VerifyResult:
    """Tokens each request emits this step: accepted drafts, then one recovered or bonus token.

    Held on the host (verification ends with one device-to-host copy); the padded tensor views are
    built on demand."""

    emitted: list[list[int]]  # [B] per request: accepted drafts + the recovered/bonus token
    num_draft: list[int]  # [B] drafts verified per request

    @property
    def num_requests(self) -> int:
        return len(self.num_draft)

    @property
    def output_tokens(self) -> torch.Tensor:  # [B, max_k + 1] int64 (CPU), padded with -1
        out = torch.full((len(self.emitted), max(self.num_draft, default=0) + 1), -1, dtype=torch.int64)
        for i, e in enumerate(self.emitted):
            out[i, : len(e)] = torch.tensor(e, dtype=torch.int64)
        return out

    @property
    def num_accepted(self) -> torch.Tensor:  # [B] int64 (CPU)
        return torch.tensor(self.num_accepted_list(), dtype=torch.int64)

    @property
    def num_emitted(self) -> torch.Tensor:  # [B] int64 (CPU)
        return self.num_accepted + 1

    def to_lists(self) -> list[list[int]]:
        """Emitted tokens per request."""
        return self.emitted

    def num_accepted_list(self) -> list[int]:
        return [len(e) - 1 for e in self.emitted]

    def match_bits(self) -> list[str]:
        """Per request: "1" per accepted draft, then "0" if a draft was rejected (greedy: the
        draft/target match pattern up to the first mismatch)."""
        if len(self.emitted) != len(self.num_draft):
            raise ValueError(f"{len(self.emitted)} emitted lists for {len(self.num_draft)} requests")
        out, table = [], _MATCH_BITS
        for e, k in zip(self.emitted, self.num_draft):
            a = len(e) - 1  # accepted
            out.append(table[k][a] if 0 <= k < len(table) and a <= k else _match_bits(k, a))
        return out


@dataclass
class _Layout:
    """Padded views of the ragged proposals (all on the proposals' device)."""

    valid: torch.Tensor  # [B, K] bool: draft j exists for request i
    draft: torch.Tensor  # [B, K] int64 draft tokens, -1 where invalid
    draft_index: torch.Tensor  # [B, K] int64 index into the flat drafts, N where invalid
    rows: torch.Tensor  # [B, K] int64 target row scoring draft j, 0 where invalid
    first_row: torch.Tensor  # [B] int64 target row of request i's offset 0
    num_draft: torch.Tensor  # [B] int64


def _check(proposals: Proposals, num_target_rows: int) -> None:
    num_req, num_tok = proposals.num_requests, proposals.num_tokens
    if any(k < 0 for k in proposals.num_draft):
        raise ValueError(f"num_draft must be >= 0, got {proposals.num_draft}")
    if proposals.cu_num_draft.shape != (num_req + 1,):
        raise ValueError(
            f"cu_num_draft must be [{num_req + 1}] for {num_req} requests, "
            f"got shape {tuple(proposals.cu_num_draft.shape)}"
        )
    if proposals.draft_tokens.shape != (num_tok,):
        raise ValueError(f"draft_tokens must be [{num_tok}], got shape {tuple(proposals.draft_tokens.shape)}")
    if num_target_rows != num_tok + num_req:
        raise ValueError(
            f"target has {num_target_rows} rows; {num_req} requests with {num_tok} drafts need "
            f"{num_tok + num_req} (k_i + 1 per request)"
        )


def _layout(proposals: Proposals, num_target_rows: int, device: torch.device) -> _Layout:
    _check(proposals, num_target_rows)
    num_req, max_k, num_tok = proposals.num_requests, proposals.max_k, proposals.num_tokens
    cu = proposals.cu_num_draft.to(device, non_blocking=True)  # host tensors travel without a sync
    num_draft = cu[1:] - cu[:-1]
    offsets = torch.arange(max_k, device=device)
    valid = offsets.unsqueeze(0) < num_draft.unsqueeze(1)  # [B, K]
    draft_index = torch.where(valid, cu[:-1].unsqueeze(1) + offsets, num_tok)
    padded = torch.cat(
        [proposals.draft_tokens.to(device, non_blocking=True), torch.full((1,), -1, device=device)]
    )
    first_row = cu[:-1] + torch.arange(num_req, device=device)
    return _Layout(
        valid=valid,
        draft=padded[draft_index],
        draft_index=draft_index,
        rows=torch.where(valid, first_row.unsqueeze(1) + offsets, 0),
        first_row=first_row,
        num_draft=num_draft,
    )


def _leading_true(accept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, K] bool -> (kept [B, K] bool prefix mask, count [B] int64) of the leading trues."""
    kept = accept.to(torch.int64).cumprod(dim=1)
    return kept.bool(), kept.sum(dim=1)


def _assemble(
    layout: _Layout, kept: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor, num_draft: list[int]
) -> PendingRead[VerifyResult]:
    """One device-to-host copy, when read: each row is the padded output tokens, then num_accepted."""
    out = torch.where(kept, layout.draft, -1)  # [B, K]
    out = torch.cat([out, final.unsqueeze(1), num_accepted.unsqueeze(1)], dim=1)  # [B, K + 2]
    num_draft = list(num_draft)
    return PendingRead(out, lambda rows: VerifyResult([r[: r[-1]] + [r[-2]] for r in rows], num_draft))


def verify_greedy(
    target_logits: torch.Tensor,  # [N + B, V]
    proposals: Proposals,
) -> VerifyResult:
    """Greedy verification: accept while argmax p_j == d_j; emit argmax at the first mismatch, or
    the bonus argmax after all k_i are accepted. Equal to non-speculative greedy decoding by
    construction (every emitted token is the target argmax given the accepted prefix). The argmax
    runs on the logits' device; the comparison walks the host copy (:func:`launch_greedy`, read)."""
    return launch_greedy(target_logits, proposals).result()


def launch_greedy(
    target_logits: torch.Tensor,  # [N + B, V]
    proposals: Proposals,
) -> PendingRead[VerifyResult]:
    """:func:`verify_greedy`'s device op queued; its read (one host copy) and host walk are left to
    the caller's ``result()``."""
    if target_logits.dim() != 2:
        raise ValueError(f"target_logits must be [rows, vocab], got shape {tuple(target_logits.shape)}")
    num_rows = target_logits.shape[0]
    _check(proposals, num_rows)
    argmax = target_logits.argmax(dim=-1)  # [N + B]
    drafts, num_draft = proposals.draft_tokens, list(proposals.num_draft)
    if num_rows == proposals.num_requests:  # no drafts at all (non-speculative): each emits its argmax
        return PendingRead(argmax, lambda host: VerifyResult([[t] for t in host], num_draft))
    if drafts.device.type == "cpu":  # the proposer's drafts are on the host already
        draft_list = drafts.tolist()
        return PendingRead(argmax, lambda host: _walk_greedy(host + draft_list, num_rows, num_draft))
    # drafts on the device: one device-to-host copy of the argmaxes and the drafts
    both = torch.cat([argmax, drafts.to(argmax.device)])
    return PendingRead(both, lambda host: _walk_greedy(host, num_rows, num_draft))


def _walk_greedy(host: list[int], num_rows: int, num_draft: list[int]) -> VerifyResult:
    """``host``: the ``num_rows`` target argmaxes, then the flat drafts."""
    emitted, row, d = [], 0, num_rows  # row: request's first target row; d: its first draft in host
    for k in num_draft:
        if not k:  # no drafts: the target's token
            emitted.append([host[row]])
            row += 1
            continue
        a = 0
        while a < k and host[row + a] == host[d + a]:
            a += 1
        emitted.append(host[d : d + a] + [host[row + a]])
        row, d = row + k + 1, d + k
    return VerifyResult(emitted, num_draft)


def verify_sampled(
    target_probs: torch.Tensor,  # [N + B, V] float32
    proposals: Proposals,
    uniforms_accept: torch.Tensor,  # [N] in [0, 1), one per draft token (flat draft layout)
    uniforms_resample: torch.Tensor,  # [B] in [0, 1), one per request
) -> VerifyResult:
    """:func:`launch_sampled`, read."""
    return launch_sampled(target_probs, proposals, uniforms_accept, uniforms_resample).result()


def launch_sampled(
    target_probs: torch.Tensor,  # [N + B, V] float32
    proposals: Proposals,
    uniforms_accept: torch.Tensor,  # [N] in [0, 1), one per draft token (flat draft layout)
    uniforms_resample: torch.Tensor,  # [B] in [0, 1), one per request
) -> PendingRead[VerifyResult]:
    """Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

    Draft j is accepted iff ``u_j * q_j(d_j) < p_j(d_j)`` (i.e. u_j < min(1, p/q)); q is
    ``proposals.draft_probs`` or one-hot at d_j when that is None. The recovered token is drawn
    from norm(max(0, p_j - q_j)) at the first rejection (p_j if that has no mass), the bonus
    token from p_{k_i}, both by inverse CDF with ``uniforms_resample``. ``draft_probs`` must come
    from the same temperature/top-k/top-p as ``target_probs`` (the draft proposer's job).
    """
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be [rows, vocab], got shape {tuple(target_probs.shape)}")
    device, vocab = target_probs.device, target_probs.shape[1]
    num_req, num_tok = proposals.num_requests, proposals.num_tokens
    layout = _layout(proposals, target_probs.shape[0], device)
    if uniforms_accept.shape != (num_tok,):
        raise ValueError(f"uniforms_accept must be [{num_tok}], got shape {tuple(uniforms_accept.shape)}")
    if uniforms_resample.shape != (num_req,):
        raise ValueError(f"uniforms_resample must be [{num_req}], got shape {tuple(uniforms_resample.shape)}")
    q_all = proposals.draft_probs
    if q_all is not None:
        if q_all.shape != (num_tok, vocab):
            raise ValueError(f"draft_probs must be [{num_tok}, {vocab}], got shape {tuple(q_all.shape)}")
        q_all = q_all.to(device, torch.float32, non_blocking=True)
    probs = target_probs.float()
    draft = layout.draft.clamp(min=0)  # [B, K], pad positions read token 0 and are masked
    p_draft = probs[layout.rows, draft]  # [B, K]
    u = torch.cat(
        [uniforms_accept.to(device, torch.float32, non_blocking=True), torch.ones(1, device=device)]
    )[layout.draft_index]
    if q_all is None:
        accept = u < p_draft
    else:
        q_draft = q_all[layout.draft_index.clamp(max=max(num_tok - 1, 0)), draft]
        accept = u * q_draft < p_draft
    kept, num_accepted = _leading_true(layout.valid & accept)

    p_final = probs[layout.first_row + num_accepted]  # [B, V]
    is_rejected = num_accepted < layout.num_draft  # [B]
    if num_tok > 0:
        at = num_accepted.clamp(max=max(proposals.max_k - 1, 0)).unsqueeze(1)  # [B, 1]
        if q_all is None:
            rej_draft = draft.gather(1, at)  # [B, 1]
            q_final = torch.zeros_like(p_final).scatter_(1, rej_draft, 1.0)
        else:
            q_final = q_all[layout.draft_index.gather(1, at).squeeze(1).clamp(max=num_tok - 1)]
        residual = (p_final - q_final * is_rejected.unsqueeze(1)).clamp(min=0)
        has_mass = residual.sum(dim=-1, keepdim=True) > 0
        p_final = torch.where(has_mass, residual, p_final)
    final = sample_from_probs(p_final, uniforms_resample.to(device, non_blocking=True))
    return _assemble(layout, kept, num_accepted, final, proposals.num_draft)


def verify(
    target_logits: torch.Tensor,  # [N + B, V]
    proposals: Proposals,
    sampling: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> VerifyResult:
    """:func:`launch_verify`, read."""
    return launch_verify(target_logits, proposals, sampling, generators).result()


def launch_verify(
    target_logits: torch.Tensor,  # [N + B, V]
    proposals: Proposals,
    sampling: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> PendingRead[VerifyResult]:
    """Verify a mixed batch. Greedy requests (temperature 0) follow the argmax rule; sampled ones
    use :func:`logits_to_probs` and :func:`verify_sampled`. Request i's k_i + 1 uniforms (k_i for
    acceptance, one for the recovered/bonus token) come from ``generators[i]`` (the global RNG
    when None), so a seeded request reproduces under the same plan. ``proposals.draft_probs`` must
    have been computed with each request's own temperature/top-k/top-p.

    Greedy rows inside a sampled batch are exact too: their p is one-hot at the argmax, their
    uniforms are 0, so a draft is kept iff it is the argmax and the recovered/bonus token is the
    argmax, whatever q is.
    """
    num_req = proposals.num_requests
    if len(sampling) != num_req or len(generators) != num_req:
        raise ValueError(
            f"{num_req} requests but {len(sampling)} sampling params and {len(generators)} generators"
        )
    if all(sp.temperature == 0.0 for sp in sampling):  # all greedy (SamplingParams.is_greedy, inlined)
        return launch_greedy(target_logits, proposals)
    device = target_logits.device
    u_accept, u_resample = [], []  # host tensors: request i's k_i accept uniforms, then 1 resample
    for sp, gen, k in zip(sampling, generators, proposals.num_draft, strict=True):
        if sp.is_greedy:
            u = torch.zeros(k + 1)
        elif gen is None:
            u = torch.rand(k + 1)
        else:
            u = torch.rand(k + 1, generator=gen, device=gen.device).cpu()
        u_accept.append(u[:k])
        u_resample.append(u[k:])
    repeats = [k + 1 for k in proposals.num_draft]
    probs = logits_to_probs(target_logits, SamplingTensors.from_params(sampling, repeats, device))
    u_accept_t = torch.cat(u_accept).to(device, non_blocking=True)  # host uniforms: no sync
    return launch_sampled(probs, proposals, u_accept_t, torch.cat(u_resample).to(device, non_blocking=True))
