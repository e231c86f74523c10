"""A grpc.aio server interceptor on every pdserve gRPC server: each unary call is counted and timed
(``pdserve:rpc_requests_total{method,code}``, ``pdserve:rpc_duration_seconds{method}``, in this
process's default registry), and a request message with a ``rid`` binds it for the call's log lines.
Streaming calls pass through untouched."""

from __future__ import annotations

import functools
import time

import grpc
from prometheus_client import Counter, Histogram

from pdserve.observability.logs import rid_bound

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60)


@functools.cache
def _metrics() -> tuple[Counter, Histogram]:
    """The RPC metrics of this process, registered once in ``prometheus_client.REGISTRY``."""
    calls = Counter(
        "pdserve:rpc_requests", "Unary gRPC calls served, by method and status", ["method", "code"]
    )
    seconds = Histogram("pdserve:rpc_duration_seconds", "Unary gRPC call time", ["method"], buckets=_BUCKETS)
    return calls, seconds


class RpcObserver(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        _metrics()  # registered with the server, so that they are exposed before the first call

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        inner = handler.unary_unary
        calls, seconds = _metrics()

        async def observed(request, context: grpc.aio.ServicerContext):
            start = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                with rid_bound(getattr(request, "rid", "")):
                    return await inner(request, context)
            except Exception:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            finally:
                calls.labels(method, code.name).inc()
                seconds.labels(method).observe(time.perf_counter() - start)

        return grpc.unary_unary_rpc_method_handler(
            observed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
