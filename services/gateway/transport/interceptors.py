"""gRPC server interceptors of the public API: a request message that does not parse is refused with
INVALID_ARGUMENT (``MalformedRequestInterceptor``), not grpcio's UNKNOWN and a logged traceback."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.message import DecodeError


@dataclass(frozen=True, slots=True)
class _Malformed:
    """Handed to a method in place of a request message that did not parse; ``message`` says why."""

    message: str


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT ("request is not a valid pdserve.v1.GenerateRequest: ...") for a request
    message that does not parse, on every method with a unary request (stream-request methods pass
    through unchanged).

    grpcio parses the request before the method runs, and answers a parse failure with UNKNOWN and a
    logged traceback; here the parse failure becomes a ``_Malformed`` value that the wrapped method
    refuses before the servicer sees it. Place it after ``ApiKeyInterceptor``, whose refusal then
    wins over a malformed request's.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}  # by method: built once, not per call

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        wrapped = self._wrapped.get(details.method)
        if wrapped is None:
            wrapped = self._wrapped[details.method] = self._wrap(details.method, handler)
        return wrapped

    @staticmethod
    def _wrap(full_method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        service, _, method = full_method.lstrip("/").rpartition("/")
        name = descriptor_pool.Default().FindMethodByName(f"{service}.{method}").input_type.full_name
        parse = handler.request_deserializer

        def parse_or_flag(data: bytes) -> Any:
            try:
                return parse(data)
            except DecodeError as e:
                return _Malformed(f"request is not a valid {name}: {e}")

        streams = handler.response_streaming
        make = grpc.unary_stream_rpc_method_handler if streams else grpc.unary_unary_rpc_method_handler
        behavior = _refusing_malformed(handler.unary_stream if streams else handler.unary_unary)
        return make(
            behavior, request_deserializer=parse_or_flag, response_serializer=handler.response_serializer
        )


def _refusing_malformed(behavior: Callable) -> Callable:
    """``behavior`` (a coroutine or async-generator method) ending the call with INVALID_ARGUMENT when
    its request is ``_Malformed``."""
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request, context: grpc.aio.ServicerContext):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in behavior(request, context):
                yield response

        return streaming

    async def unary(request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return unary
