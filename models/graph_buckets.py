"""Graph buckets: the shapes CUDA graphs are captured at, and padding a batch up to one.

A :class:`GraphBucket` is one captured shape (rows, tokens, max_q). Decode buckets (rows == tokens,
q_len 1) serve plain decode, batch-expansion scoring and a draft model's single-token steps; MQA
buckets capture ``max_q`` (the longest row) as an upper bound. Sizes follow :func:`size_ladder`.

Padding layout (a real batch of r rows / t tokens in a bucket of R rows / T tokens; see
:func:`pad_inputs`):

- tokens t..T-1 are pad tokens: input id 0, position 0, KV slot 0 (block 0 is reserved as the pad
  target and never given to a request);
- rows r..R-1 are pad rows: the first min(R-r, T-t) own one pad token each (q_len 1, seq_len_k 1,
  block table all 0, so each attends to key 0 of block 0), the rest have q_len 0 and seq_len_k 0
  (the attention kernel skips them). Pad tokens beyond the pad rows belong to no row: their
  attention output is left unwritten, but every other op is per token and their K/V land in block
  0, which no real row's visible keys reach, so real rows never see them;
- block-table columns beyond the real width are 0; ``max_q``/``max_k`` are the captured bounds.

Host path (what the runner does each step): the real batch is a :class:`HostInputs` of numpy arrays;
:meth:`HostInputs.write` lays it out, padded, in one byte buffer (:class:`InputLayout`: the int64
inputs, then the int32 metadata, then optional int64 tails), so the whole step's input travels in
one host-to-device copy whose device views are the graph's inputs. :func:`pad_inputs` is the same
padding done on device tensors (the path for inputs that already live on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from specsched.kernels.metadata import AttentionMetadata

PAD_SLOT = 0  # block 0, offset 0: the reserved pad block


@dataclass(frozen=True)
class GraphBucket:
    """One captured shape: ``rows`` attention rows, ``tokens`` tokens, any row's q_len <= ``max_q``."""

    rows: int
    tokens: int
    max_q: int

    def __post_init__(self) -> None:
        if self.rows < 1 or self.tokens < 1 or self.max_q < 1:
            raise ValueError(f"graph bucket needs rows, tokens, max_q >= 1, got {self}")
        if self.tokens > self.rows * self.max_q:
            raise ValueError(f"graph bucket {self} can never be filled: tokens > rows * max_q")

    @property
    def is_decode(self) -> bool:
        return self.max_q == 1

    def fits(self, rows: int, tokens: int, max_q: int) -> bool:
        return rows <= self.rows and tokens <= self.tokens and max_q <= self.max_q


def size_ladder(max_size: int) -> list[int]:
    """Bucket sizes 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... (powers of two, and 1.5x them from 16 on)
    below ``max_size``, then ``max_size`` itself."""
    if max_size < 1:
        raise ValueError(f"max bucket size must be >= 1, got {max_size}")
    out, p = [], 1
    while p < max_size:
        out.append(p)
        if p >= 16 and p * 3 // 2 < max_size:
            out.append(p * 3 // 2)
        p *= 2
    return [*out, max_size]


def token_bucket(n: int) -> int:
    """The token count an eager forward of ``n`` tokens is padded to: ``n`` up to 16, then the next
    multiple of 1/8 of ``n``'s power-of-two octave (at most 12.5% padding). Eager forwards (prefill
    chunks, eager scoring, a draft's catch-up) then meet a bounded set of GEMM shapes, which the
    start-up warm-up runs once each: a GEMM shape cuBLAS meets first while serving costs a heuristic
    search and a kernel load on that step."""
    if n <= 16:
        return max(n, 0)
    step = 1 << (n.bit_length() - 1 - 3)  # an eighth of the octave [2^m, 2^(m+1)) holding n
    return -(-n // step) * step


def token_buckets(max_tokens: int) -> list[int]:
    """Every :func:`token_bucket` value of 1 .. ``max_tokens`` (and the bucket of ``max_tokens``)."""
    out, n = [], 1
    while n <= max_tokens:
        b = token_bucket(n)
        out.append(b)
        n = b + 1
    return out


def decode_buckets(max_rows: int) -> list[GraphBucket]:
    """Single-query rows (decode, batch expansion, draft steps): rows == tokens, q_len 1."""
    return [GraphBucket(n, n, 1) for n in size_ladder(max_rows)]


def mqa_buckets(max_rows: int, max_q: int) -> list[GraphBucket]:
    """Varlen rows with q_len <= ``max_q``: for each row count R of the ladder, token counts of the
    ladder between R (exclusive: that is a decode bucket) and R * max_q (inclusive)."""
    if max_q < 2:
        raise ValueError(f"MQA buckets need max_q >= 2 (max_k >= 1), got {max_q}")
    return [
        GraphBucket(r, t, min(max_q, t))
        for r in size_ladder(max_rows)
        for t in size_ladder(r * max_q)
        if t > r
    ]


def prefill_buckets(max_rows: int, max_tokens: int, min_tokens: int = 32) -> list[GraphBucket]:
    """Prefill chunks (a few rows of many tokens each, logits of each row's last token): rows 1, 2,
    4, ... up to ``max_rows`` by tokens ``min_tokens``, 2x, 4x, ... up to ``max_tokens``, any row's
    q_len up to the bucket's tokens. Powers of two keep the set small (20 graphs for 8 rows x 512
    tokens): a chunk pads to at most twice its tokens, which a launch-bound forward hardly feels."""
    if max_rows < 1 or max_tokens < 1:
        raise ValueError(f"prefill buckets need max_rows, max_tokens >= 1, got {max_rows}, {max_tokens}")
    rows = [1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows] + [max_rows]
    tokens, t = [], min(min_tokens, max_tokens)
    while t < max_tokens:
        tokens.append(t)
        t *= 2
    tokens.append(max_tokens)
    return [GraphBucket(r, t, t) for r in rows for t in tokens if t >= r]


def as_bucket(b: GraphBucket | tuple[int, ...]) -> GraphBucket:
    """A bucket from a tuple: (rows, tokens) is decode when rows == tokens, else q_len <= tokens."""
    if isinstance(b, GraphBucket):
        return b
    if len(b) == 3:
        return GraphBucket(*b)
    if len(b) != 2:
        raise ValueError(f"a bucket is (rows, tokens) or (rows, tokens, max_q), got {b!r}")
    rows, tokens = b
    return GraphBucket(rows, tokens, 1 if rows == tokens else tokens)


def pad_inputs(
    input_ids: torch.Tensor,  # [t] int64
    positions: torch.Tensor,  # [t] int64
    meta: AttentionMetadata,  # r rows, t tokens
    rows: int,
    tokens: int,
    width: int,  # block-table columns of the bucket
    max_q: int,
    max_k: int,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:  # [tokens], [tokens], meta of `rows` rows
    """Pad a real batch to a bucket's shapes with the layout of the module docstring (no host sync)."""
    r, t, w = meta.num_rows, meta.num_tokens, meta.block_tables.shape[1]
    if rows < r or tokens < t or width < w:
        raise ValueError(f"cannot pad {r} rows / {t} tokens / width {w} into {rows} / {tokens} / {width}")
    pad_rows, pad_tokens = rows - r, tokens - t
    dev = meta.seq_lens_k.device
    owned = torch.arange(1, pad_rows + 1, dtype=torch.int32, device=dev).clamp_(max=pad_tokens)  # [pad_rows]
    cu_tail = owned + meta.cu_seqlens_q[-1:]  # cu_seqlens_q[-1] == t
    seq_tail = (torch.arange(pad_rows, dtype=torch.int32, device=dev) < pad_tokens).to(torch.int32)
    padded = AttentionMetadata(
        cu_seqlens_q=torch.cat([meta.cu_seqlens_q, cu_tail]),
        seq_lens_k=torch.cat([meta.seq_lens_k, seq_tail]),
        block_tables=F.pad(meta.block_tables, (0, width - w, 0, pad_rows)),
        slot_mapping=F.pad(meta.slot_mapping, (0, pad_tokens), value=PAD_SLOT),
        max_q=max_q,
        max_k=max_k,
    )
    return F.pad(input_ids, (0, pad_tokens)), F.pad(positions, (0, pad_tokens)), padded


# ---- host path: one byte buffer per step ----------------------------------------------------------------
@dataclass(frozen=True)
class InputLayout:
    """Byte layout of one batch's inputs in a buffer: ``input_ids``, ``positions``, ``slot_mapping``
    (int64 [tokens] each), ``cu_seqlens_q`` [rows+1], ``seq_lens_k`` [rows], ``block_tables``
    [rows, width] (int32), then at an 8-byte boundary the optional int64 tails ``logits_indices``
    [num_logits], ``scatter_index`` [num_scatter] and ``gather_index`` [num_gather]. A graph
    captured on the base views of a bucket's layout reads any later batch written with the same
    (tokens, rows, width)."""

    tokens: int
    rows: int
    width: int
    num_logits: int = 0
    num_scatter: int = 0
    num_gather: int = 0

    @property
    def base_nbytes(self) -> int:  # the graph inputs, rounded up to 8 bytes
        return -(-(24 * self.tokens + 4 * (2 * self.rows + 1 + self.rows * self.width)) // 8) * 8

    @property
    def nbytes(self) -> int:
        return self.base_nbytes + 8 * (self.num_logits + self.num_scatter + self.num_gather)

    @property
    def tails(self) -> tuple[int, int, int]:
        return self.num_logits, self.num_scatter, self.num_gather

    def with_tails(self, num_logits: int, num_scatter: int, num_gather: int) -> InputLayout:
        return InputLayout(self.tokens, self.rows, self.width, num_logits, num_scatter, num_gather)

    def split(self, buf: np.ndarray | torch.Tensor) -> tuple:
        """Views of a uint8 buffer (numpy or torch): ids, positions, slots, cu_seqlens_q, seq_lens_k,
        block_tables [rows, width], logits_indices, scatter_index, gather_index."""
        is_np = isinstance(buf, np.ndarray)
        i64, i32 = (np.int64, np.int32) if is_np else (torch.int64, torch.int32)
        t, r, w = self.tokens, self.rows, self.width
        a = 24 * t
        b = a + 4 * (r + 1)
        c = b + 4 * r
        d = c + 4 * r * w
        return (
            buf[0 : 8 * t].view(i64),
            buf[8 * t : 16 * t].view(i64),
            buf[16 * t : a].view(i64),
            buf[a:b].view(i32),
            buf[b:c].view(i32),
            buf[c:d].view(i32).reshape(r, w),
            *self.split_tails(buf),
        )

    def split_tails(self, buf: np.ndarray | torch.Tensor) -> tuple:
        """The tails' views only: logits_indices, scatter_index, gather_index."""
        i64 = np.int64 if isinstance(buf, np.ndarray) else torch.int64
        e = self.base_nbytes + 8 * self.num_logits
        f = e + 8 * self.num_scatter
        return buf[self.base_nbytes : e].view(i64), buf[e:f].view(i64), buf[f : self.nbytes].view(i64)


@dataclass
class HostInputs:
    """A real batch of r rows / t tokens on the host (numpy), before padding and upload."""

    input_ids: np.ndarray  # [t] int64; placeholders at scatter_index when ids come from the device
    positions: np.ndarray  # [t] int64
    slot_mapping: np.ndarray  # [t] int64
    cu_seqlens_q: np.ndarray  # [r+1] int
    seq_lens_k: np.ndarray  # [r] int
    block_tables: np.ndarray  # [r, w] int32, rows padded with 0
    max_q: int
    max_k: int
    logits_indices: np.ndarray | None = None  # [L] int64: tokens whose logits are wanted (None: all)
    scatter_index: np.ndarray | None = None  # [S] int64: tokens whose ids come from a device tensor
    gather_index: np.ndarray | None = None  # [S] int64: which of the device ids go there (None: all)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.seq_lens_k.shape[0])

    @property
    def width(self) -> int:
        return int(self.block_tables.shape[1])

    @property
    def num_tails(self) -> tuple[int, int, int]:
        """Lengths of the int64 tails: (logits indices, scatter index, gather index)."""
        return tuple(
            0 if a is None else len(a) for a in (self.logits_indices, self.scatter_index, self.gather_index)
        )

    def layout(self) -> InputLayout:
        """This batch's own (unpadded) layout."""
        return InputLayout(self.num_tokens, self.num_rows, self.width, *self.num_tails)

    def write(self, lay: InputLayout, buf: np.ndarray) -> None:  # buf: uint8 [>= lay.nbytes]
        """Write the batch into ``buf`` with ``lay``'s shapes, padded as the module docstring says."""
        r, t, w = self.num_rows, self.num_tokens, self.width
        if lay.rows < r or lay.tokens < t or lay.width < w:
            raise ValueError(
                f"cannot pad {r} rows / {t} tokens / width {w} into {lay.rows} / {lay.tokens} / {lay.width}"
            )
        if lay.tails != self.num_tails:
            raise ValueError(f"layout tails {lay.tails} != the batch's {self.num_tails}")
        ids, pos, slots, cu, seq, tables, logits, scatter, gather = lay.split(buf[: lay.nbytes])
        pad_rows, pad_tokens = lay.rows - r, lay.tokens - t
        ids[:t], ids[t:] = self.input_ids, 0
        pos[:t], pos[t:] = self.positions, 0
        slots[:t], slots[t:] = self.slot_mapping, PAD_SLOT
        cu[: r + 1] = self.cu_seqlens_q
        seq[:r] = self.seq_lens_k
        if pad_rows:  # pad row j owns pad token j (q_len 1, 1 key in block 0) while pad tokens last
            owned = np.minimum(np.arange(1, pad_rows + 1), pad_tokens)
            cu[r + 1 :] = t + owned
            seq[r:] = np.arange(pad_rows) < pad_tokens
        tables[:r, :w] = self.block_tables
        if lay.width > w:
            tables[:r, w:] = 0
        tables[r:] = 0
        if self.logits_indices is not None:
            logits[:] = self.logits_indices
        if self.scatter_index is not None:
            scatter[:] = self.scatter_index
        if self.gather_index is not None:
            gather[:] = self.gather_index

    def to_device(
        self, device: torch.device | str, device_ids: torch.Tensor | None = None, *, pad_tokens: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """(input_ids, positions, metadata, logits_indices or None) on ``device``, in one host-to-device
        copy (plus the scatter of ``device_ids`` into the ids when given). With ``pad_tokens`` the
        tokens are padded to :func:`token_bucket` (pad tokens belong to no row and write their K/V to
        the pad slot; the first ``num_tokens`` outputs are the real ones); else unpadded."""
        lay = self.layout()
        if pad_tokens:
            lay = replace(lay, tokens=token_bucket(lay.tokens))
        host = np.empty(lay.nbytes, dtype=np.uint8)
        self.write(lay, host)
        buf = torch.from_numpy(host).to(device, non_blocking=True)
        ids, pos, slots, cu, seq, tables, logits, scatter, gather = lay.split(buf)
        if device_ids is not None:
            self.scatter_ids(ids, scatter, gather, device_ids)
        meta = AttentionMetadata(cu, seq, tables, slots, self.max_q, self.max_k)
        return ids, pos, meta, (logits if self.logits_indices is not None else None)

    def scatter_ids(
        self, ids: torch.Tensor, scatter: torch.Tensor, gather: torch.Tensor, device_ids: torch.Tensor
    ) -> None:
        """``ids[scatter] = device_ids[gather]`` (``device_ids`` as they are without a gather index):
        one ``index_copy_``, plus one ``index_select`` with a gather index."""
        if (device_ids is None) != (self.scatter_index is None):
            raise ValueError("device ids and HostInputs.scatter_index must be given together")
        src = device_ids.to(ids.device, torch.int64)
        if self.gather_index is not None:
            src = src.index_select(0, gather)
        ids.index_copy_(0, scatter, src)
