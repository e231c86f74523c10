"""API-key authentication (``Authorization: Bearer <key>``) for the HTTP API and the public gRPC API.

HTTP: an ASGI middleware that answers 401 in OpenAI's error shape before the body is read, for every
path except the open ones (``/health``, ``/metrics``). gRPC: the public ``pdserve.v1.PdServe``
methods abort with UNAUTHENTICATED; the internal services (``GatewayOutput``, health, reflection)
stay open.
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


async def check_grpc_key(context: grpc.aio.ServicerContext, api_key: str | None) -> None:
    """Abort the call with UNAUTHENTICATED unless its ``authorization`` metadata carries ``api_key``.

    Called at the top of each public ``PdServe`` method. (An interceptor would be the natural
    place, but ``pdserve.rpc.server.GrpcServer`` builds its ``grpc.aio.server`` without one.)
    """
    if api_key is None:
        return
    metadata = dict(context.invocation_metadata() or ())
    error = check_bearer(metadata.get("authorization"), api_key)
    if error is not None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, error.message)
