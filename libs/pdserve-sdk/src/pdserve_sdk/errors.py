"""Typed exceptions for the gRPC status codes the pdserve gateway answers with."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import grpc.aio


class PdServeError(Exception):
    """A failed call: ``code`` is the gRPC status, ``message`` the server's details text.

    Subclasses name the codes a caller handles differently; any other code (INTERNAL, CANCELLED,
    UNIMPLEMENTED, ...) is raised as ``PdServeError`` itself.
    """

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(f"{code.name}: {message}")
        self.message = message
        self.code = code


class InvalidRequestError(PdServeError):
    """INVALID_ARGUMENT, OUT_OF_RANGE or FAILED_PRECONDITION: fix the request, do not retry it."""


class AuthenticationError(PdServeError):
    """UNAUTHENTICATED or PERMISSION_DENIED: missing or wrong API key."""


class NotFoundError(PdServeError):
    """NOT_FOUND: unknown model (or rid, for an abort)."""


class RateLimitError(PdServeError):
    """RESOURCE_EXHAUSTED: the server is full; retry later."""


class DeadlineExceededError(PdServeError):
    """DEADLINE_EXCEEDED: the call's ``timeout`` passed; the server aborts the request."""


class ServiceUnavailableError(PdServeError):
    """UNAVAILABLE: no server reachable, or a backend is down (after the configured retries)."""


_BY_CODE: dict[grpc.StatusCode, type[PdServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequestError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimitError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailableError,
}


def error_from_status(code: grpc.StatusCode, message: str) -> PdServeError:
    """The exception for status ``code`` carrying ``message``."""
    return _BY_CODE.get(code, PdServeError)(message, code)


@contextmanager
def translated_errors() -> Iterator[None]:
    """Re-raise a ``grpc.RpcError`` (sync or ``grpc.aio``) from the block as a ``PdServeError``."""
    try:
        yield
    except grpc.RpcError as err:
        if not isinstance(err, grpc.Call | grpc.aio.AioRpcError):  # calls raise these, carrying a status
            raise
        raise error_from_status(err.code(), err.details() or err.code().name) from None
