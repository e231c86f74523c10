"""Errors in OpenAI's JSON shape, and their mapping to and from gRPC status codes.

Every failure the gateway reports is a ``GatewayError``: the HTTP layer renders it as
``{"error": {"message", "type", "param", "code"}}`` with its status, the public gRPC servicer aborts
with the matching ``grpc.StatusCode``, and errors from backend services (``grpc.aio.AioRpcError``)
become ``GatewayError`` through ``from_rpc_error``.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any, TypeVar

import grpc
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

# HTTP status -> (OpenAI error type, gRPC status code).
_KINDS: dict[int, tuple[str, grpc.StatusCode]] = {
    400: ("invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    401: ("authentication_error", grpc.StatusCode.UNAUTHENTICATED),
    404: ("invalid_request_error", grpc.StatusCode.NOT_FOUND),
    405: ("invalid_request_error", grpc.StatusCode.UNIMPLEMENTED),
    409: ("invalid_request_error", grpc.StatusCode.ALREADY_EXISTS),
    413: ("invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    429: ("rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED),
    499: ("cancelled", grpc.StatusCode.CANCELLED),
    503: ("service_unavailable", grpc.StatusCode.UNAVAILABLE),
    504: ("timeout", grpc.StatusCode.DEADLINE_EXCEEDED),
}

# Backend gRPC status -> HTTP status.
_FROM_GRPC: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class GatewayError(Exception):
    """A request failure with its HTTP status and OpenAI error fields.

    Args:
        status: HTTP status code (400, 401, 404, 413, 429, 503, 504, 500, ...).
        message: human-readable message (shown to the client).
        param: the request field at fault, dotted (``"messages"``, ``"sampling_params.top_p"``).
        code: machine-readable code (``"model_not_found"``, ``"invalid_api_key"``, ...).
        headers: extra response headers (``Retry-After`` for 429/503).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        kind = _KINDS.get(self.status)
        return kind[0] if kind else ("invalid_request_error" if self.status < 500 else "internal_error")

    @property
    def grpc_code(self) -> grpc.StatusCode:
        kind = _KINDS.get(self.status)
        if kind:
            return kind[1]
        return grpc.StatusCode.INVALID_ARGUMENT if self.status < 500 else grpc.StatusCode.INTERNAL

    def body(self) -> dict:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``; text a client
        sent that is not valid Unicode (a lone surrogate, echoed in a message) is escaped."""
        message, param = _utf8_safe(self.message), self.param and _utf8_safe(self.param)
        return {"error": {"message": message, "type": self.type, "param": param, "code": self.code}}


def _utf8_safe(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (lone surrogates) as ``\\udXXX`` escapes."""
    return text.encode("utf-8", "backslashreplace").decode()


def http_error(status: int, message: str | None = None, **kwargs) -> GatewayError:
    """A ``GatewayError`` whose message defaults to the status phrase (``"Not Found"``)."""
    return GatewayError(status, message or HTTPStatus(status).phrase, **kwargs)


def invalid_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param)


def context_length_exceeded(message: str, param: str) -> GatewayError:
    """A prompt (or prompt + max_tokens) over the model's context; ``param`` "messages" or "prompt"."""
    return GatewayError(400, message, param=param, code="context_length_exceeded")


RETRY_AFTER_S = 1  # the Retry-After of every 429 and 503


def retry_after() -> dict[str, str]:
    """The headers of a response the client should retry (429, 503)."""
    return {"Retry-After": str(RETRY_AFTER_S)}


def generation_failed(error: str, retryable: bool = False) -> GatewayError:
    """A choice the runtime ended with finish_reason "error": 500, or 503 with ``Retry-After`` when
    ``retryable`` (the server's state failed it: overload, a worker that hung or died)."""
    if retryable:
        return GatewayError(503, error or "the server cannot serve the request now", headers=retry_after())
    return GatewayError(500, f"generation failed: {error or 'unknown error'}")


def duplicate_rid(rid: str) -> GatewayError:
    """409 (gRPC ALREADY_EXISTS) for a request whose rid another request in flight holds."""
    return GatewayError(409, f"request id {rid!r} is already in flight", param="rid", code="duplicate_rid")


# Backend gRPC status -> the OpenAI error code the gateway's own refusals of that kind carry: a
# scheduler's NOT_FOUND is a LoRA adapter it does not hold (unloaded while the request travelled).
_CODES: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.NOT_FOUND: "model_not_found",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "too_many_requests",
}


def from_rpc_error(err: grpc.aio.AioRpcError, service: str) -> GatewayError:
    """Map a backend call's failure: INVALID_ARGUMENT->400, NOT_FOUND->404 ``model_not_found``,
    RESOURCE_EXHAUSTED->429 ``too_many_requests``, UNAVAILABLE->503, ...

    A client error (4xx) carries the backend's message alone: which internal ``service`` (a role and
    address) found the request wrong is of no use to the client; server errors name it.
    """
    status = _FROM_GRPC.get(err.code(), 500)
    headers = retry_after() if status in (429, 503) else None
    details = err.details() or err.code().name
    message = details if status < 500 else f"{service}: {details}"
    return GatewayError(status, message, code=_CODES.get(err.code()), headers=headers)


_Model = TypeVar("_Model", bound=BaseModel)


def validate_as_body(model: type[_Model], fields: dict[str, Any]) -> _Model:
    """``fields`` validated by ``model``; a failure raises the 400 HTTP answers for that JSON body."""
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        as_body = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        raise validation_to_gateway_error(RequestValidationError(as_body)) from None


# pydantic error types of a body that is not an object (a JSON array, string or null; form data).
_NOT_AN_OBJECT = frozenset({"model_attributes_type", "model_type", "dict_type"})


def validation_to_gateway_error(exc: RequestValidationError) -> GatewayError:
    """A 400 naming the first offending field (``param``), e.g. ``"temperature: Input should be ..."``."""
    errors = exc.errors()
    if not errors:
        return GatewayError(400, "invalid request")
    err = _most_specific(errors)
    if err["type"] == "json_invalid":
        return GatewayError(400, f"invalid JSON body: {(err.get('ctx') or {}).get('error', err['msg'])}")
    if err["type"] in _NOT_AN_OBJECT and tuple(err["loc"]) == ("body",):
        return GatewayError(
            400, "the request body must be a JSON object (sent with Content-Type: application/json)"
        )
    param = (err.get("ctx") or {}).get("param") or _field(err) or None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        message = f"'{param}' is required" if param else "request body is required"
    else:
        named = param and re.search(rf"(?<![\w.]){re.escape(param)}(?![\w.])", msg)  # as a word: "n"
        message = msg if not param or named else f"{param}: {msg}"
    others = len({_field(e) for e in errors} - {_field(err)})  # a union's members count once
    if others:
        message += f" (and {others} more error{'s' if others > 1 else ''})"
    return GatewayError(400, message, param=param)


def _field(err: dict) -> str:
    """The dotted body field of a pydantic error (``""`` outside the body), union members left out."""
    loc = err["loc"]
    return ".".join(str(p) for p in loc[1:] if not _is_union_tag(p)) if loc[:1] == ("body",) else ""


def _most_specific(errors: list[dict]) -> dict:
    """The error to report: for a union field (``stop``: a string or a list of them), pydantic
    reports every member that failed; the one whose type matched (its error not a type mismatch,
    e.g. "at most 64 items") says what is wrong, not "Input should be a valid string"."""
    first = errors[0]
    loc = tuple(first["loc"])
    if not loc or not _is_union_tag(loc[-1]) or not first["type"].endswith("_type"):
        return first
    field = loc[:-1]
    members = (e for e in errors[1:] if tuple(e["loc"])[: len(field)] == field and len(e["loc"]) > len(field))
    specific = (e for e in members if _is_union_tag(e["loc"][len(field)]) and not e["type"].endswith("_type"))
    return next(specific, first)


def _is_union_tag(part: object) -> bool:
    """pydantic names the union member tried in ``loc`` (``str``, ``list[int]``, ``constrained-str``);
    not a field name."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool") or "[" in part or part.startswith("constrained-")
    )
