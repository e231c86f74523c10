"""A local OTLP/gRPC trace receiver for tests: the OpenTelemetry collector's TraceService, served from
this test process with the official generated code (``opentelemetry-proto``), keeping every span."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class Span:
    """One received span; ids in hex, times in ns since the epoch."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start: int
    end: int
    attributes: dict = field(hash=False)


def _value(v: common_pb2.AnyValue) -> object:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """``start()`` listens on 127.0.0.1 (``endpoint``); ``spans`` grows as services export."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    span = Span(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        service=str(resource.get("service.name", "")),
                        start=s.start_time_unix_nano,
                        end=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                    )
                    with self._lock:
                        self.spans.append(span)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, done: Callable[[list[Span]], bool], timeout: float = 30.0) -> list[Span]:
        """Poll until ``done(spans)``; returns the spans. Raises AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"spans not complete after {timeout} s; have {names}")
            time.sleep(0.2)
