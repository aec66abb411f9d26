"""What the engine thread sends for a step's outputs (a mixin of :class:`~specsched.daemon.serving.Serving`).

Each :class:`RequestOutput` advances its request's stream (request_stream.py): new ids, text (or a
:class:`LateText` the IO thread detokenizes), stop strings, counters; a streaming request gets a
``chunk``. A finished request gets its ``done`` (or ``error``) after its last chunk and, with a durable
decision log, only once the log's writer has committed its row (:class:`HeldReplies`). Every step's
record goes to the log (``_on_step``); a failing log is reported once and never stops serving.
"""

from __future__ import annotations

import logging
import time

from specsched.daemon.messages import Chunk, Error, ErrorCode, Message
from specsched.daemon.request_stream import LateText, RequestStream
from specsched.engine.records import RequestOutput, StepRecord
from specsched.engine.request import FinishReason

logger = logging.getLogger("specsched.daemon.serving")  # the serving loop's logger, as before the split


class ServingOutputs:
    """The output half of :class:`~specsched.daemon.serving.Serving`; it reads the state Serving's
    constructor sets up (``engine``, ``log``, ``streams``, ``by_client``, ``counts``, ``held``,
    ``_finals``, ``_stop_hits``, ``_is_in_window``, ``step_stats``, ``_chained_on_step``) and sends
    with its ``send``."""

    def _on_step(self, rec: StepRecord) -> None:
        if self._chained_on_step is not None:
            self._chained_on_step(rec)
        self.step_stats.observe(rec)
        if self.log is not None:
            self._log_call(self.log.write_step, rec)

    def _on_output(self, out: RequestOutput, now: float | None = None) -> None:
        """``now``: when the step that produced ``out`` returned (its first token's time)."""
        st = self.streams.get(out.request_id)
        if st is None:
            return
        reason = out.finish_reason
        if reason is not None:
            reason = str(getattr(reason, "value", reason))
        new_ids = out.new_token_ids  # advance copies what it keeps
        if st.is_text_deferred:  # the IO thread detokenizes (request_stream.py)
            st.token_ids.extend(new_ids)
            text, is_hit = "", False
        else:
            text, is_hit = st.advance(new_ids, finishing=reason is not None)
        if new_ids:
            st.steps += 1
            if not st.first_token_time:
                st.first_token_time = now or time.time()
        st.proposed += out.num_proposed
        st.accepted += out.num_accepted
        if is_hit:
            if reason is None and self._is_in_window:  # the request is in the running step
                self._stop_hits.append(st.key)
            elif reason is None:
                self.engine.abort_request(st.key, FinishReason.STOP)
            reason = FinishReason.STOP.value
        if st.is_streaming and (new_ids or text):
            chunk = Chunk(st.id, list(new_ids), text, out.num_proposed, out.num_accepted)
            if st.is_text_deferred:
                st.is_flushed = reason is not None
                self.send(st.client, LateText(chunk, st.detok, st.is_flushed))
            else:
                self.send(st.client, chunk)
        if reason is not None:
            self._finish(st, reason)

    def _finish(self, st: RequestStream, reason: str, reply: bool = True, error: str | None = None) -> None:
        last: Message | None = None  # the request's last message: sent once its log row is settled
        if reply and error is not None:
            last = Error(st.id, ErrorCode.INTERNAL.value, error)
        elif reply:
            if not st.is_text_deferred:
                text, _ = st.advance([], finishing=True)  # what was held back (nothing after a normal finish)
                if st.is_streaming and text:
                    self.send(st.client, Chunk(st.id, [], text))
            elif st.is_streaming and not st.is_flushed:  # the IO thread drops it when nothing was held
                self.send(st.client, LateText(Chunk(st.id, [], ""), st.detok, True))
            elif not st.is_streaming:
                st.deferred_text()
            last = st.done(reason)
        kinds = {"stop": "done", "length": "done", "abort": "aborted", "timeout": "timed_out"}
        self.counts[kinds.get(reason, "errored")] += 1
        del self.streams[st.key]
        keys = self.by_client[st.client]
        keys.discard(st.key)
        if not keys:
            del self.by_client[st.client]
        seq = None
        if self.log is not None:
            seq = self._log_call(
                self.log.write_request,
                st.key,
                client=st.client,
                arrival=st.arrival_time,
                first_token_time=st.first_token_time,
                finish_time=time.time(),
                prompt_tokens=st.num_prompt_tokens,
                output_tokens=len(st.token_ids),
                finish_reason=reason,
                proposed=st.proposed,
                accepted=st.accepted,
                prompt_hash=st.prompt_hash,
            )
        if last is None:
            return
        if self.held is not None and isinstance(seq, int):
            self._finals.append((seq, st.client, last))  # held once the list with its chunks is posted
        else:  # no log, log.durable=false, or the row was dropped (counted): nothing to wait for
            self.send(st.client, last)

    def _log_call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 -- the log must never stop serving
            if not self._is_log_broken:
                self._is_log_broken = True
                logger.exception("decision log call failed (reported once)")
