"""The engine's prefill step: a chunk of new prompts through the target, each finished prompt's first
token sampled (:class:`PrefillStep`, a part of :class:`~specsched.engine.engine.Engine`)."""

from __future__ import annotations

import time

import torch

from specsched.engine.proposing import by_proposer
from specsched.engine.records import RequestOutput, StepRecord
from specsched.engine.request import Request
from specsched.engine.scheduler import ScheduledBatch
from specsched.proposers.base import Proposals
from specsched.scorers.inputs import chunk_host_inputs, tokens_from


class PrefillStep:
    """The prefill step of :class:`~specsched.engine.engine.Engine` (which it is a base of: it reads the
    engine's model, KV cache, prefill runner, proposers, timer and commit)."""

    def _prefill(self, batch: ScheduledBatch) -> tuple[list[RequestOutput], StepRecord]:
        reqs, chunks = batch.requests, batch.chunk_lens
        rec = StepRecord(self.num_steps, "prefill", time.time(), len(reqs), sum(chunks))
        starts = [r.num_computed for r in reqs]
        ends = [s + c for s, c in zip(starts, chunks)]
        sample = [
            i for i, (r, e) in enumerate(zip(reqs, ends)) if not r.output_ids and e == r.num_prompt_tokens
        ]
        tokens = [tokens_from(r, s)[:c] for r, s, c in zip(reqs, starts, chunks)]
        logits = self._prefill_logits(rec, tokens, starts, [r.block_table for r in reqs], sample)
        for r, e in zip(reqs, ends):
            r.num_computed = e
        done = [reqs[i] for i in sample]
        empty = Proposals.from_lists([[] for _ in done])  # host tensors: no device copy
        with self._timed(rec, "verify_ms", is_adjacent=True):  # the first tokens, sampled behind the forward
            pending = self._launch_verify(logits, done, empty, 1)
        self._while_prefilling(reqs)
        first, _ = self._read_verify(pending)  # waits for the device (see DecodeSteps._read_verify)
        self.timer.mark_tail(rec, "verify_ms")
        now = time.time()
        for r in done:
            r.first_token_time = now
        rec.num_emitted = len(done)
        return self._commit(done, first, [0] * len(done), None), rec

    def _prefill_logits(self, rec, tokens, starts, tables, sample: list[int]) -> torch.Tensor:  # [S, vocab]
        """The chunk's forward, logits of the last token of rows ``sample``: on the prefill graphs
        when a bucket fits (each row's last token, then the sampled rows), else eagerly with the
        tokens padded to a token bucket on CUDA (counted as the prefill runner's fallback)."""
        runner, bs = self.prefill_runner, self.cfg.cache.block_size
        x = chunk_host_inputs(tokens, starts, tables, bs)  # logits of every row's last token
        if runner is not None:
            bucket, reason, detail = runner.bucket_for(x)
            if bucket is not None:
                with self._timed(rec, "score_ms"):
                    logits = runner.run_host(x)  # [rows, vocab]
                    return logits if len(sample) == len(tokens) else logits[sample]
            runner.note_fallback(reason, detail)
        x.logits_indices = x.logits_indices[sample]
        ids, pos, meta, last = x.to_device(self.device, pad_tokens=self.device.type == "cuda")
        with self._timed(rec, "score_ms"):
            return self.model(ids, pos, meta, self.kv_cache, last)

    def _while_prefilling(self, reqs: list[Request]) -> None:
        """Host work while the GPU runs a prefill forward (CUDA; on the host path it is simply done
        here): the proposers prepare for the requests' first decode step (``on_prefill``; the n-gram
        proposer indexes the prompt, which a first decode step's peek would otherwise do on the
        critical path: ~0.15 ms per joining request on the H200 host, 2026-12-04). The caller's
        ``on_host_window`` goes first, as in a decode step's window."""
        self._is_window_open = False
        self._open_window()
        names = self._proposer_names(reqs)
        by = by_proposer(names)
        for n, idx in by.items():
            self.proposers[n].on_prefill(reqs if len(by) == 1 else [reqs[i] for i in idx])
