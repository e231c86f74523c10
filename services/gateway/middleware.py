"""ASGI middlewares of the HTTP API: the request id, and the request body's size and time limits.

They answer errors in OpenAI's JSON shape (starlette's own body limit answers plain text).
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.observability import tracing
from pdserve.observability.logs import bind_rid
from pdserve.sampling.bounds import MAX_RID_CHARS
from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.openai.serving_common import REQUEST_ID_HEADER, new_rid


async def _send_error(error: GatewayError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)


class RequestIdMiddleware:
    """The rid of each request: ``X-Request-Id`` (at most 256 printable ASCII characters) or a fresh
    one; echoed back.

    Stored as ``request.state.rid`` and bound for log lines (``observability.logs``); a handler may
    replace it (native ``rid``) before it responds.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = (Headers(scope=scope).get(REQUEST_ID_HEADER) or "").strip()
        problem = (
            f"is longer than {MAX_RID_CHARS} characters"
            if len(given) > MAX_RID_CHARS
            else "must be printable ASCII"  # (other bytes would come back changed: headers are latin-1)
            if not (given.isascii() and given.isprintable())
            else None
        )
        if problem:
            error = GatewayError(400, f"{REQUEST_ID_HEADER} {problem}", param=REQUEST_ID_HEADER)
            await _send_error(error, scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["rid"] = given or new_rid()
        bind_rid(state["rid"])  # this request's task: its lines, uvicorn's access line included
        tracing.tag_current_span(state["rid"])

        async def send_with_rid(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", state["rid"].encode())]
            await send(message)

        await self.app(scope, receive, send_with_rid)


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a streamed body passes the limit (FastAPI re-raises HTTPException)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes")


class BodySizeLimitMiddleware:
    """413 for bodies over ``max_bytes``: at once from Content-Length, else while the body is read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            message = BodyTooLarge(self.max_bytes).detail
            await _send_error(GatewayError(413, message, code="request_too_large"), scope, receive, send)
            return
        received = 0

        async def receive_with_limit() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, receive_with_limit, send)


class BodyTimeout(HTTPException):
    """Raised from ``receive`` when a body has not fully arrived in time: 408 with ``Connection: close``
    (the rest of the body, should it come, is not read as a next request)."""

    def __init__(self, timeout_s: float) -> None:
        message = f"the request body did not arrive in full within {timeout_s:g} seconds"
        super().__init__(408, message, headers={"Connection": "close"})


class BodyTimeoutMiddleware:
    """408 for a request whose body has not fully arrived ``timeout_s`` seconds after its headers.

    uvicorn waits for a body as long as its client keeps the connection open: a client that declares
    a length and sends less would hold the connection (and the handler waiting for it) forever. Once
    the body is complete, ``receive`` (which then waits for the client to disconnect) has no deadline.
    """

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        body_done = False

        async def receive_by_deadline() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(self.timeout_s) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_by_deadline, send)
