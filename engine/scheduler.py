"""Admission, KV blocks and preemption.

Block 0 of the cache is reserved (the pad target of captured graphs); blocks 1.. are handed out
from a free list. A request owns ``ceil(slots / block_size)`` blocks for the slots it needs: its
tokens, plus the k+1 lookahead slots a speculative step writes; after verification the rejected
slots are rolled back by length and whole blocks beyond the committed tokens are freed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specsched.engine.config import CacheConfig, SchedulerConfig
from specsched.engine.request import FinishReason, Request


class NoFreeBlocks(RuntimeError):
    pass


class BlockAllocator:
    """Free-list allocator over blocks ``1 .. num_blocks-1`` (block 0 is the reserved pad block)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


@dataclass
class ScheduledBatch:
    """One step's work: either prefill chunks or a decode (speculative) batch."""

    requests: list[Request]
    is_prefill: bool
    chunk_lens: list[int]  # prefill: tokens computed this step per request; decode: unused

    @property
    def batch_size(self) -> int:
        return len(self.requests)


class Scheduler:
    """``prefill_limits`` (prompts, tokens): the largest prefill chunk set the prefill CUDA graphs
    take; a prefill step stays within them (and the token budget), so none runs eagerly. None: the
    token budget alone (eager prefill, or no prefill graphs)."""

    def __init__(
        self, cfg: SchedulerConfig, cache: CacheConfig, num_blocks: int,
        prefill_limits: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        if prefill_limits is not None and min(prefill_limits) < 1:
            raise ValueError(f"prefill_limits (prompts, tokens) must be >= 1, got {prefill_limits}")
        rows, tokens = prefill_limits or (cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.max_prefill_rows = rows
        self.prefill_budget = min(cfg.max_num_batched_tokens, tokens)
        self.block_size = cache.block_size
        self.allocator = BlockAllocator(num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- bookkeeping -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def reserve(self, req: Request, num_slots: int) -> bool:
        """Make ``req.block_table`` cover ``num_slots`` slots; False (nothing changed) if out of blocks."""
        need = self.blocks_for(num_slots) - len(req.block_table)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        req.block_table.extend(self.allocator.allocate(need))
        return True

    def trim(self, req: Request) -> None:
        """Free whole blocks beyond the request's tokens (rollback of rejected lookahead slots)."""
        keep = self.blocks_for(req.num_tokens)
        if len(req.block_table) > keep:
            self.allocator.free(req.block_table[keep:])
            del req.block_table[keep:]

    def release(self, req: Request) -> None:
        """Free every block of a request (finished, aborted or preempted)."""
        self.allocator.free(req.block_table)
        req.block_table = []

    def finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        self.release(req)
        if not _remove(self.running, req):
            _remove(self.waiting, req)

    def preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop its KV, requeue at the front; its tokens are kept."""
        self.release(req)
        req.num_computed = 0
        req.num_draft_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        _remove(self.running, req)
        self.waiting.appendleft(req)

    # ---- scheduling ----------------------------------------------------------------------------
    @staticmethod
    def prefill_target(req: Request) -> int:
        """Tokens to compute before decoding: the prompt for a fresh request; every token but the
        last for a resumed (preempted) one."""
        num_prompt, num_out = len(req.prompt_ids), len(req.output_ids)
        return num_prompt + num_out - 1 if num_out else num_prompt

    def schedule(self) -> ScheduledBatch | None:
        """Prefill first (chunked under a token budget, at most ``max_prefill_rows`` prompts), else one
        decode step over all running."""
        budget = self.prefill_budget
        # admit waiting requests while there is room
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            first_chunk = min(self.prefill_target(req) - req.num_computed, budget)
            # keep one block of headroom per running request so decodes are not starved at once
            if self.blocks_for(req.num_computed + first_chunk + 1) > self.allocator.num_free - len(
                self.running
            ):
                break
            self.running.append(self.waiting.popleft())
        prefills, chunks, decodes = [], [], []
        for req in self.running:
            todo = self.prefill_target(req) - req.num_computed
            if todo <= 0:
                decodes.append(req)
                continue
            if budget <= 0 or len(prefills) == self.max_prefill_rows:
                continue
            n = min(todo, budget)
            # a chunk that completes a fresh prompt samples the first token: reserve its slot too
            if not self.reserve(req, req.num_computed + n + 1):
                continue
            prefills.append(req)
            chunks.append(n)
            budget -= n
        if prefills:
            return ScheduledBatch(prefills, True, chunks)
        if not decodes:
            return None
        return ScheduledBatch(decodes, False, [])

    def reserve_lookahead(self, batch: list[Request], k: list[int]) -> tuple[list[Request], list[int]]:
        """Reserve ``num_tokens + k_i`` slots per request. When blocks run out, k drops to 0 for the
        requests that do not fit; when even one slot does not fit, the newest running request is
        preempted. Returns the requests that stay in this step and their k."""
        kept, ks = [], []
        running = {id(r) for r in self.running}  # by identity: Request's == compares every field
        num_running, block_size = len(running), self.block_size
        for req, ki in zip(batch, k):
            if id(req) not in running:  # not running, or preempted below in this call
                continue
            num_tokens = len(req.prompt_ids) + len(req.output_ids)  # req.num_tokens
            if num_tokens + ki <= len(req.block_table) * block_size:  # covered already (most steps)
                kept.append(req)
                ks.append(ki)
                continue
            while not self.reserve(req, num_tokens + ki):
                if ki > 0:
                    ki = 0
                    continue
                victim = self.running[-1]
                self.preempt(victim)
                running.discard(id(victim))
                if victim is req:
                    break
            else:
                kept.append(req)
                ks.append(ki)
        if len(running) == num_running:  # nobody preempted
            return kept, ks
        survivors = [(r, ki) for r, ki in zip(kept, ks) if id(r) in running]
        return [r for r, _ in survivors], [ki for _, ki in survivors]


def _remove(queue: list[Request] | deque[Request], req: Request) -> bool:
    """Remove ``req`` itself (by identity: Request's dataclass ``==`` compares every field) from
    ``queue``; False when it is not there."""
    for i, r in enumerate(queue):
        if r is req:
            del queue[i]
            return True
    return False
