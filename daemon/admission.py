"""Admission of a ``generate``, in two stages (docs/operations.md lists every limit).

On the IO thread, at once, from its own counters (:func:`early_rejection`): shutting down, duplicate
id, in flight per client and in all, queue depth; then the prompt's tokenization
(:func:`tokenize_prompt`) where the tokenizer may encode beside the engine thread. On the engine thread
(:func:`build_request`): the tokenization otherwise, and the checks that need the engine -- prompt
length against the context,
``max_prompt_tokens`` and the KV cache, ``max_output_tokens``, the proposer's name and the queue's
exact depth; the message becomes the engine's :class:`Request` or a :class:`ProtocolError` naming why
it cannot run.
"""

from __future__ import annotations

from specsched.daemon.commands import Admit
from specsched.daemon.messages import ErrorCode, Generate, ProtocolError
from specsched.engine.request import Request, SamplingParams, SpecParams


def request_key(client: bytes, request_id: str) -> str:
    """The engine's request id: unique across clients (ids are only unique per client)."""
    return f"{client.hex()}:{request_id}"


def tokenize_prompt(msg: Generate, tok) -> list[int]:
    """``msg``'s prompt as token ids: ``prompt_ids`` as sent, ``prompt`` encoded, or ``messages``
    rendered with the chat template and encoded (``tok``: the model's
    :class:`~specsched.models.tokenizer.Tokenizer`, None for a model without one); raises
    :class:`ProtocolError` naming the field. The IO thread calls it for a tokenizer that may encode
    beside the engine thread (``Tokenizer.is_thread_safe``), so the engine thread does not pay
    ~0.2-0.4 ms a chat request (SmolLM2, dev CPU) between its steps; :func:`build_request` otherwise."""
    if tok is None and (msg.prompt is not None or msg.messages is not None or msg.stop):
        name = "prompt" if msg.prompt is not None else "messages" if msg.messages is not None else "stop"
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"generate.{name}: this model has no tokenizer; send prompt_ids (and no stop strings)",
            msg.id,
        )
    try:
        if msg.prompt_ids is not None:
            return list(msg.prompt_ids)
        if msg.prompt is not None:
            return tok.encode(msg.prompt)
        return tok.apply_chat_template([{"role": m.role, "content": m.content} for m in msg.messages])
    except ValueError as e:
        field_name = "prompt" if msg.prompt is not None else "messages"
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"generate.{field_name}: {e}", msg.id) from None


def build_request(cmd: Admit, engine, cfg) -> Request:
    """The engine request for ``cmd`` (``cfg``: the daemon's config), tokenized (chat template for
    ``messages``) unless the IO thread did (``cmd.prompt_ids``), ``max_tokens`` capped by what the KV
    cache holds; raises :class:`ProtocolError`."""
    msg = cmd.msg
    ids = cmd.prompt_ids if cmd.prompt_ids is not None else tokenize_prompt(msg, engine.tokenizer)
    limit = min(cfg.max_prompt_tokens or engine.max_model_len, engine.max_model_len - 1)
    if len(ids) > limit:
        raise ProtocolError(
            ErrorCode.PROMPT_TOO_LONG,
            f"generate: the prompt has {len(ids)} tokens; this daemon takes at most {limit} "
            f"(context {engine.max_model_len}, prompt + output)",
            msg.id,
        )
    if not ids:
        raise ProtocolError(ErrorCode.INVALID_FIELD, "generate.prompt: encodes to no tokens", msg.id)
    cap = cfg.max_output_tokens
    if cap is not None and msg.max_tokens > cap:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"generate.max_tokens: this daemon generates at most {cap} tokens per request "
            f"(daemon.max_output_tokens), got {msg.max_tokens}",
            msg.id,
        )
    # what the KV cache can hold for one request alone: beyond it the request could never finish
    # (preempted, it would wait forever for blocks that do not exist), so max_tokens is capped to it
    kv_slots = engine.num_total_blocks * engine.cfg.cache.block_size
    if len(ids) >= kv_slots:
        raise ProtocolError(
            ErrorCode.PROMPT_TOO_LONG,
            f"generate: the prompt has {len(ids)} tokens; the KV cache holds {kv_slots} (prompt + output)",
            msg.id,
        )
    known = getattr(engine, "proposers", None)
    if msg.spec.proposer is not None and known is not None and msg.spec.proposer not in known:
        raise ProtocolError(
            ErrorCode.UNKNOWN_PROPOSER,
            f"generate.spec.proposer: unknown proposer {msg.spec.proposer!r}; "
            f"known: {', '.join(sorted(known))}",
            msg.id,
        )
    if engine.num_waiting >= engine.cfg.scheduler.max_queue:
        raise ProtocolError(
            ErrorCode.OVERLOADED,
            f"the queue is full ({engine.num_waiting} waiting: scheduler.max_queue)",
            msg.id,
        )
    sampling = SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=msg.seed,
        max_tokens=min(msg.max_tokens, kv_slots - len(ids)),
        stop=list(msg.stop),
    )
    spec = SpecParams(max_k=msg.spec.max_k, proposer=msg.spec.proposer)
    return Request(
        request_key(cmd.client, msg.id), ids, sampling, spec, arrival_time=cmd.arrival_time, client=cmd.client
    )


def engine_error(e: ValueError, request_id: str) -> ProtocolError:
    """Map a ValueError of ``Engine.add_request`` onto an error code (build_request catches the
    common cases first; this is the fallback)."""
    text = str(e)
    if "proposer" in text:
        return ProtocolError(ErrorCode.UNKNOWN_PROPOSER, f"generate.spec.proposer: {text}", request_id)
    if "context" in text or "KV blocks" in text:
        return ProtocolError(ErrorCode.PROMPT_TOO_LONG, f"generate: {text}", request_id)
    if "token ids" in text:
        return ProtocolError(ErrorCode.INVALID_FIELD, f"generate.prompt_ids: {text}", request_id)
    return ProtocolError(ErrorCode.INVALID_FIELD, f"generate: {text}", request_id)


def early_rejection(
    msg: Generate,
    client_ids: set[str],
    num_inflight: int,
    num_queued: int,
    max_queue: int,
    cfg,
    is_shutting_down: bool,
) -> tuple[ErrorCode, str] | None:
    """The IO thread's checks, judged at once from its own counters (``client_ids``: the ids this
    client has in flight; ``num_queued``: requests in flight that are not running): the error code and
    message for ``msg``, or None when it may go on to the engine thread."""
    if is_shutting_down:
        return ErrorCode.SHUTTING_DOWN, "the daemon is shutting down and accepts no new requests"
    if msg.id in client_ids:
        return ErrorCode.DUPLICATE_ID, f"generate.id: {msg.id!r} is already in flight here"
    if len(client_ids) >= cfg.max_inflight_per_client:
        return ErrorCode.TOO_MANY_INFLIGHT, f"{len(client_ids)} requests in flight (max_inflight_per_client)"
    if num_inflight >= cfg.max_inflight:
        return ErrorCode.OVERLOADED, f"{num_inflight} requests in flight (max_inflight)"
    if num_queued >= max_queue:
        # every request in flight that is not running is queued (or about to be): judged here, at
        # once; the engine thread checks the exact queue again when it admits the request
        return ErrorCode.OVERLOADED, f"the queue is full ({max_queue} waiting, scheduler.max_queue)"
    return None
