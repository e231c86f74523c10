"""API-key authentication (``Authorization: Bearer <key>``) for the HTTP API and the public gRPC API.

``--api-key`` holds one key or several, comma-separated (one per client or tenant): any of them is
accepted, and the key a request was sent with owns it (only that key can abort it, see
``RequestManager.abort``).

HTTP: an ASGI middleware that answers 401 in OpenAI's error shape before the body is read, for
every path except the open ones (``/health``, ``/metrics``), and keeps the caller's key in the
request's state (``http_caller``). gRPC: a server interceptor answers calls to the public
``pdserve.v1.PdServe`` methods with UNAUTHENTICATED; the internal services (``GatewayOutput``,
health, reflection) stay open; a method finds its caller's key with ``grpc_caller``.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.services.gateway.errors import GatewayError

OPEN_PATHS = frozenset({"/health", "/metrics"})


def parse_api_keys(value: str | None) -> list[str]:
    """The keys of ``--api-key`` (comma-separated, blanks dropped); [] when none is set."""
    return [key.strip() for key in (value or "").split(",") if key.strip()]


def presented_key(authorization: str | None, api_keys: Sequence[str]) -> str | None:
    """The key of ``api_keys`` that ``authorization`` (``"Bearer <key>"``) presents, else None.

    Every key is compared, each in constant time, so the time taken does not tell which matched."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    given = token.strip().encode()
    matches = [key for key in api_keys if hmac.compare_digest(given, key.encode())]
    return matches[0] if matches else None


def authenticate(authorization: str | None, api_keys: Sequence[str]) -> str:
    """The key of ``api_keys`` that ``authorization`` (``"Bearer <key>"``) presents.

    Raises:
        GatewayError: 401 when ``authorization`` is missing or presents none of the keys.
    """
    if not authorization:
        raise GatewayError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    key = presented_key(authorization, api_keys)
    if key is None:
        raise GatewayError(401, "invalid API key", code="invalid_api_key")
    return key


def http_caller(request: Request) -> str | None:
    """The API key this HTTP request was sent with (None when the gateway has no API keys)."""
    return request.scope.get("state", {}).get("api_key")


def grpc_caller(context: grpc.aio.ServicerContext, api_keys: Sequence[str]) -> str | None:
    """The API key this call was sent with (None when ``api_keys`` is empty: the gateway has none)."""
    return presented_key(dict(context.invocation_metadata() or ()).get("authorization"), api_keys)


class ApiKeyMiddleware:
    """Reject HTTP requests without one of ``api_keys`` as bearer token (401, OpenAI error JSON);
    keep the key of those that have one in their state (``http_caller``)."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self.api_keys = api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            try:
                key = authenticate(Headers(scope=scope).get("authorization"), self.api_keys)
            except GatewayError as e:
                response = JSONResponse(e.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Deny calls to ``protected`` methods (``/pdserve.v1.PdServe/...``) with UNAUTHENTICATED unless
    their ``authorization`` metadata carries one of ``api_keys``; other services pass through."""

    def __init__(self, api_keys: Sequence[str], protected: str = "/pdserve.v1.PdServe/") -> None:
        self.api_keys = api_keys
        self.protected = protected

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.protected):
            return handler
        try:
            authenticate(dict(details.invocation_metadata or ()).get("authorization"), self.api_keys)
            return handler
        except GatewayError as e:
            message = e.message

        async def deny(request, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

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
