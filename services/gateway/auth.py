"""API-key authentication (``Authorization: Bearer <key>``) for the HTTP API and the public gRPC API.

HTTP: an ASGI middleware that answers 401 in OpenAI's error shape before the body is read, for every
path except the open ones (``/health``, ``/metrics``). gRPC: a server interceptor that rejects calls
to ``pdserve.v1.PdServe`` methods with UNAUTHENTICATED; the internal services (``GatewayOutput``,
health, reflection) stay open.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.services.gateway.errors import GatewayError

OPEN_PATHS = frozenset({"/health", "/metrics"})


def check_bearer(authorization: str | None, api_key: str) -> GatewayError | None:
    """``None`` when ``authorization`` is ``"Bearer <api_key>"``, else the 401 to answer."""
    if not authorization:
        return GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return GatewayError(401, "invalid API key", code="invalid_api_key")
    return None


class ApiKeyMiddleware:
    """Reject HTTP requests without the right bearer token (401, OpenAI error JSON)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            error = check_bearer(Headers(scope=scope).get("authorization"), self.api_key)
            if error is not None:
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Check the ``authorization`` metadata on calls to methods under ``/{service}/``."""

    def __init__(self, api_key: str, service: str = "pdserve.v1.PdServe") -> None:
        self.api_key = api_key
        self.prefix = f"/{service}/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefix):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        error = check_bearer(metadata.get("authorization"), self.api_key)
        if error is None:
            return handler
        return _deny_handler(handler, error.message)


def _deny_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that aborts with UNAUTHENTICATED."""

    async def deny(_request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(_request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as a response-streaming handler must be

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
