"""API-key authentication (``Authorization: Bearer <key>``) for the HTTP API and the public gRPC API.

HTTP: an ASGI middleware that answers 401 in OpenAI's error shape before the body is read, for
every path except the open ones (``/health``, ``/metrics``). gRPC: a server interceptor answers
calls to the public ``pdserve.v1.PdServe`` methods with UNAUTHENTICATED; the internal services
(``GatewayOutput``, health, reflection) stay open.
"""

from __future__ import annotations

import hmac

import grpc
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.services.gateway.errors import GatewayError

OPEN_PATHS = frozenset({"/health", "/metrics"})


def check_bearer(authorization: str | None, api_key: str) -> GatewayError | None:
    """``None`` when ``authorization`` is ``"Bearer <api_key>"``, else the 401 to answer."""
    if not authorization:
        return GatewayError(
            401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
        )
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
    """Deny calls to ``protected`` methods (``/pdserve.v1.PdServe/...``) with UNAUTHENTICATED unless
    their ``authorization`` metadata carries the API key; other services pass through."""

    def __init__(self, api_key: str, protected: str = "/pdserve.v1.PdServe/") -> None:
        self.api_key = api_key
        self.protected = protected

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.protected):
            return handler
        error = check_bearer(dict(details.invocation_metadata or ()).get("authorization"), self.api_key)
        if error is None:
            return handler

        async def deny(request, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, error.message)

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream
            else grpc.unary_unary_rpc_method_handler
        )
        return make(
            deny,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
