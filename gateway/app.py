"""The FastAPI app: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent
events or not), ``GET /v1/models``, ``GET /v1/models/{model}`` and ``GET /health``.

Every request first asks the daemon's ``health`` (a daemon that is down answers 503 at once, not after a
timeout), then streams from the daemon whatever the HTTP client asked for: a non-stream response is
assembled from the chunks, so a long generation never hits the per-reply timeout, and a client that
disconnects, before or during its response, cancels its request in the daemon (streaming.py).
"""

from __future__ import annotations

import hmac
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from specsched.client import AsyncClient, SpecschedError
from specsched.gateway.config import GatewayConfig
from specsched.gateway.daemon_link import DaemonLink
from specsched.gateway.errors import APIError, from_client_error, install_handlers
from specsched.gateway.responses import SSE_DONE, ChatShape, CompletionShape, Shape, sse
from specsched.gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest
from specsched.gateway.streaming import ClientGone, DisconnectWatch, EventStreamResponse

CLIENT_CLOSED = 499  # nginx's "client closed request": the status nobody reads


def create_app(cfg: GatewayConfig, client: AsyncClient | None = None) -> FastAPI:
    """The gateway app. Without ``client``, the app's lifespan makes one (inside the server's loop)
    and closes it at shutdown; a ``client`` given must belong to the loop that serves the app."""
    link = DaemonLink(cfg, client)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await link.open()
        try:
            yield
        finally:
            await link.close()

    app = FastAPI(title="specsched gateway", lifespan=lifespan)
    app.state.link = link
    install_handlers(app)

    def check_key(request: Request) -> None:
        if cfg.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @app.get("/health")
    async def health() -> dict:
        reply = await link.health()
        return {"status": "ok", "model": cfg.model or reply.model, "daemon_uptime_s": reply.uptime_s}

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(await link.model_name(), started)]}

    @v1.get("/models/{model:path}")
    async def model(model: str) -> dict:
        name = await link.model_name()
        if model != name:
            raise unknown_model(model, name)
        return model_card(name, started)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await complete(link, request, body, ChatShape)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await complete(link, request, body, CompletionShape)

    app.include_router(v1)
    return app


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "specsched"}


def unknown_model(asked: str, served: str) -> APIError:
    return APIError(404, f"The model `{asked}` does not exist: this server serves `{served}`", param="model",
                    code="model_not_found")  # fmt: skip


async def complete(link: DaemonLink, request: Request, body: SamplingRequest, shape_type: type[Shape]):
    cfg = link.cfg
    name = await link.model_name()
    if body.model != name:
        raise unknown_model(body.model, name)
    rid = uuid.uuid4().hex
    shape = shape_type(rid, name, body.include_usage)
    try:
        stream = link.client.stream(**body.generate_args(cfg.default_max_tokens), id=rid,
                                    timeout=cfg.request_timeout_s)  # fmt: skip
    except SpecschedError as e:  # too large to send
        raise from_client_error(e) from e
    watch = DisconnectWatch(request.receive)
    try:
        chunk = first = await watch.race(anext(stream, None))  # the daemon's errors come first
        if not body.stream:
            pieces = []
            while chunk is not None:
                pieces.append(chunk.text)
                chunk = await watch.race(anext(stream, None))
            done = stream.done
            if done.finish_reason == "error":
                raise APIError(500, "the daemon failed while serving the request", "server_error", None,
                               "internal")  # fmt: skip
            return JSONResponse(shape.full("".join(pieces), done))
    except ClientGone:
        await stream.aclose()
        return Response(status_code=CLIENT_CLOSED)
    except SpecschedError as e:
        await stream.aclose()
        raise from_client_error(e) from e
    except BaseException:
        await stream.aclose()
        raise
    finally:
        await watch.close()
    return EventStreamResponse(_events(stream, shape, first), on_close=stream.aclose)


async def _events(stream, shape: Shape, chunk):
    """The SSE events of a stream whose first chunk (or None) was read already."""
    opening = shape.opening()
    if opening is not None:
        yield sse(opening)
    try:
        while chunk is not None:
            if chunk.text:
                yield sse(shape.delta(chunk.text))
            chunk = await anext(stream, None)
    except SpecschedError as e:  # too late for a status code: an error event, as OpenAI sends
        yield sse(from_client_error(e).body())
        yield SSE_DONE
        return
    yield sse(shape.final(stream.done))
    if shape.include_usage:
        yield sse(shape.usage_chunk(stream.done))
    yield SSE_DONE
