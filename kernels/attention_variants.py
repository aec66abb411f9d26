"""Every Triton attention variant a model can launch while serving, and a warm-up that builds them.

The Triton attention kernel is compiled once per :class:`~specsched.kernels.triton_attention.LaunchConfig`
(tile sizes, split count, warps, stages: all ``tl.constexpr``) and dtype; the metadata pointers and the
block-table stride are kept out of its cache key (``runtime_args``), and the activation/cache strides
are fixed per model. :func:`launch_configs` maps the serving domain (rows, query length, keys: host
upper bounds, as ``launch_config`` sees them) onto the distinct configs, with one representative
shape each; :func:`warm_up_attention` launches each once on a one-token dummy batch (the variant does
not depend on the grid), so no launch while serving meets a new one.

``launch_config`` reads its inputs only through a few derived values (the query tile, the number of
programs, whether that is under the SM count, keys per split), so the enumeration walks those: query
lengths by powers of two up to the query tile (and multiples of it beyond), rows until the programs
exceed twice the SM count (more rows change nothing), keys at multiples of the key tile up to 16
splits and the longest row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specsched.kernels.attention_config import LaunchConfig, launch_config
from specsched.kernels.metadata import AttentionMetadata
from specsched.kernels.triton_attention import paged_attention_triton
from specsched.kernels.triton_utils import cdiv

MAX_SPLITS = 16  # launch_config's cap


@dataclass(frozen=True)
class AttentionDomain:
    """The attention launches of one model while serving, as host upper bounds."""

    num_heads: int
    kv_heads: int
    head_dim: int
    max_rows_single: int  # rows of single-query launches: decode, batch expansion, draft steps
    max_rows_multi: int  # rows of multi-query launches: MQA, prefill chunks
    max_q: int  # longest query of one row: the prefill chunk budget (>= max_k + 1 of MQA)
    max_keys: int  # longest row: max_model_len

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_heads", "head_dim", "max_rows_single", "max_rows_multi", "max_q",
                     "max_keys"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"AttentionDomain.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of kv_heads {self.kv_heads}")

    @property
    def group(self) -> int:
        return self.num_heads // self.kv_heads


def _query_lengths(d: AttentionDomain, q_tile: int) -> list[int]:
    """One query length per distinct (query tile, tiles per row) pair: powers of two below the
    widest tile, then multiples of it (the last one capped at ``max_q``)."""
    out, q = [], 1
    while q < min(q_tile, d.max_q):
        out.append(q)
        q *= 2
    out += list(range(min(q_tile, d.max_q), d.max_q + q_tile, q_tile))
    return sorted({min(q, d.max_q) for q in out})


def _key_lengths(d: AttentionDomain) -> list[int]:
    tiles = (32, 64, 128)  # every block_n launch_config picks
    keys = {min(b * s, d.max_keys) for b in tiles for s in range(1, MAX_SPLITS + 1)}
    return sorted(keys | {1, d.max_keys})


def launch_configs(d: AttentionDomain, num_sms: int) -> dict[LaunchConfig, tuple[int, int, int]]:
    """The distinct launch configs of ``d`` -> one (rows, max_q, max_k) that yields each."""
    q_tile = launch_config(d.max_q, d.max_keys, 1, d.group, d.kv_heads, d.head_dim, num_sms=num_sms).block_q
    q_tile = max(q_tile, 1)
    found: dict[LaunchConfig, tuple[int, int, int]] = {}
    keys = _key_lengths(d)
    for max_q in _query_lengths(d, q_tile):
        max_rows = d.max_rows_single if max_q == 1 else d.max_rows_multi
        for rows in range(1, max_rows + 1):
            last = None
            for max_k in keys:
                if max_k < max_q:
                    continue
                cfg = launch_config(max_q, max_k, rows, d.group, d.kv_heads, d.head_dim, num_sms=num_sms)
                found.setdefault(cfg, (rows, max_q, max_k))
                last = cfg
            if last is not None and rows * cdiv(max_q, last.block_q) * d.kv_heads > 2 * num_sms:
                break  # past this, more rows give the same configs
    return found


def warm_up_attention(
    configs: list[LaunchConfig],
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]: a layer's real cache
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    num_heads: int,
    scale: float,
    progress=None,  # called once per config launched (a tqdm's update)
) -> None:
    """Launch every config once on a one-token batch over the pad block 0 (its output is thrown
    away; block 0 is never a real request's), so each variant is compiled before serving."""
    dev, dtype = k_cache.device, k_cache.dtype
    i32 = dict(dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 1], **i32),
        seq_lens_k=torch.tensor([1], **i32),
        block_tables=torch.zeros((1, 1), **i32),
        slot_mapping=torch.zeros(1, dtype=torch.int64, device=dev),
        max_q=1,
        max_k=1,
    )
    q = torch.zeros((1, num_heads, k_cache.shape[-1]), dtype=dtype, device=dev)
    for cfg in configs:
        paged_attention_triton(q, k_cache, v_cache, meta, scale, config=cfg)
        if progress is not None:
            progress(1)
