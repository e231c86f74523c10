"""The FastAPI application: routes, OpenAI-shaped error handlers, and middlewares.

Middlewares, outermost first: request counting, request id (``X-Request-Id`` in, echoed out), API
key (401 before the body is read), body-size limit (413), body time limit (408). Every error a client can
cause answers in OpenAI's ``{"error": {...}}`` shape with its status, never 500; unexpected
exceptions answer 500 in the same shape and the service keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.observability import tracing
from pdserve.services.gateway.auth import ApiKeyMiddleware
from pdserve.services.gateway.errors import (
    GatewayError,
    http_error,
    invalid_request,
    validation_to_gateway_error,
)
from pdserve.services.gateway.health import check_health
from pdserve.services.gateway.lora_admin import LoadLoraAdapterRequest, LoraAdmin, UnloadLoraAdapterRequest
from pdserve.services.gateway.metrics import (
    GatewayMetrics,
    RequestCountMiddleware,
    render_merged,
    scrape_backends,
)
from pdserve.services.gateway.middleware import (
    BodySizeLimitMiddleware,
    BodyTimeoutMiddleware,
    RequestIdMiddleware,
)
from pdserve.services.gateway.openai.native_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    NativeGenerateRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from pdserve.services.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.services.gateway.openai.protocol_responses import ModelCard, ModelList
from pdserve.services.gateway.openai.responses.protocol import ResponsesRequest
from pdserve.services.gateway.openai.responses.serving import OpenAIServingResponses
from pdserve.services.gateway.openai.responses.store import ResponseStore
from pdserve.services.gateway.openai.serving_chat import OpenAIServingChat
from pdserve.services.gateway.openai.serving_common import ServingContext
from pdserve.services.gateway.openai.serving_completions import OpenAIServingCompletion
from pdserve.services.gateway.openai.serving_embeddings import EmbeddingRequest, OpenAIServingEmbedding
from pdserve.services.gateway.openai.serving_generate import NativeServing
from pdserve.services.gateway.routing.worker_monitor import WorkerMonitor
from pdserve.services.gateway.routing.workers import WorkerPool
from pdserve.services.gateway.transport.backend_clients import BackendClients

logger = logging.getLogger(__name__)

ENDPOINTS = (
    "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/generate",
    "/tokenize", "/detokenize", "/health", "/metrics", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
)  # fmt: skip


@dataclass
class GatewayState:
    """Everything the routes use. ``worker_name`` labels the gateway's own metrics; ``responses``
    keeps the stored responses of /v1/responses."""

    ctx: ServingContext
    monitor: WorkerMonitor
    clients: BackendClients
    metrics: GatewayMetrics
    metric_pools: list[WorkerPool]
    worker_name: str
    lora: LoraAdmin
    responses: ResponseStore = field(default_factory=ResponseStore)


def build_app(
    state: GatewayState,
    api_keys: Sequence[str] = (),
    max_request_bytes: int | None = None,
    request_body_timeout: float | None = None,
) -> FastAPI:
    """The HTTP app over ``state``; ``api_keys`` guard every path but /health and /metrics, a body
    over ``max_request_bytes`` gets 413, one not in full within ``request_body_timeout`` seconds 408."""
    app = FastAPI(title="pdserve gateway", strict_content_type=False, telemetry=tracing.HTTP_TELEMETRY)
    chat = OpenAIServingChat(state.ctx)
    completions = OpenAIServingCompletion(state.ctx)
    embeddings = OpenAIServingEmbedding(state.ctx)
    native = NativeServing(state.ctx)
    responses = OpenAIServingResponses(state.ctx, state.responses)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        listed = state.ctx.listed_models()
        return ModelList(data=[await _model_card(state.ctx, name, parent) for name, parent in listed])

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> ModelCard:
        adapter = state.ctx.check_model(model)
        return await _model_card(state.ctx, model, state.ctx.served_model_name if adapter else None)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await state.lora.load(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await state.lora.unload(body))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        return await embeddings.create(body, request)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
        return responses.retrieve(response_id, request)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> JSONResponse:
        return responses.delete(response_id, request)

    @app.post("/generate")
    async def generate(body: NativeGenerateRequest, request: Request) -> Response:
        return await native.generate(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await native.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await native.detokenize(body)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.ctx.manager.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        healthy, body = await check_health(state.monitor)
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        backends = await scrape_backends(state.clients, state.metric_pools)
        text = render_merged(state.metrics, state.worker_name, backends)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    _add_error_handlers(app)
    # add_middleware wraps: the last added runs first.
    if request_body_timeout is not None:
        app.add_middleware(BodyTimeoutMiddleware, timeout_s=request_body_timeout)
    if max_request_bytes is not None:
        app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(RequestCountMiddleware, metrics=state.metrics, endpoints=ENDPOINTS)
    return app


async def _model_card(ctx: ServingContext, name: str, parent: str | None) -> ModelCard:
    """The served model under ``name`` (one of its served names, or an adapter of ``parent``), as
    /v1/models lists it (``max_model_len`` None while the tokenizer is down)."""
    try:
        context_length = (await ctx.manager.model_info()).context_length
    except GatewayError:
        context_length = None
    return ModelCard(id=name, max_model_len=context_length, parent=parent)


def _error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(_request: Request, exc: GatewayError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(validation_to_gateway_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else None
        return _error_response(http_error(exc.status_code, detail, headers=exc.headers))

    @app.exception_handler(UnicodeEncodeError)
    async def not_unicode(_request: Request, exc: UnicodeEncodeError) -> JSONResponse:
        # JSON may escape half of a surrogate pair ("\ud800"), which no UTF-8 text (nor protobuf) holds
        bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
        return _error_response(
            invalid_request(f"the request's text is not valid Unicode: {exc.reason} ({bad})")
        )

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return _error_response(GatewayError(500, f"internal error: {type(exc).__name__}: {exc}"))
