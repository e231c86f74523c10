"""OpenTelemetry tracing: one trace per request across gateway, tokenizer, schedulers and detokenizer.

Optional: ``pip install 'pdserve[tracing]'`` (opentelemetry-sdk, the OTLP/gRPC exporter and the gRPC
instrumentation); nothing is imported or patched unless ``--otlp-traces-endpoint`` is given.

How a trace is built:

- gateway: an HTTP server span per request from FastAPI's own OpenTelemetry support (``HTTP_TELEMETRY``),
  a child of the client's W3C ``traceparent`` header when there is one, tagged with the rid
  (``tag_current_span``); the public gRPC API gets its server span from the OpenTelemetry gRPC
  instrumentation, which also reads ``traceparent`` from the call's metadata.
- every internal request-path RPC (Tokenize, Generate, Prefill, Abort, ...): client and server spans
  from the instrumentation, which carries ``traceparent`` in the gRPC metadata. Probes (health, load,
  metrics) and the long-lived output streams are not traced.
- schedulers: a ``<role>.request`` span per request from its arrival to its end, child of the
  Generate (or Prefill) server span, with one child per phase, timed from the ``Req`` timestamps
  (``request_phases``); decode's Prefill call to a prefill worker is made inside it.
- detokenizer: a ``detokenize`` span from a request's first output to its last, child of the
  decode worker's request span, whose ``traceparent`` travels in the first ``TokenIDOutput``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from pdserve.scheduler.req import FinishReason, Req

logger = logging.getLogger(__name__)

_tracer: Any = None  # an opentelemetry Tracer once configure_tracing ran with an endpoint
# RPCs that are not on a request's path: probes, agent handshakes, the long-lived output streams
_UNTRACED_METHODS = (
    "GetLoad", "GetMetrics", "GetInfo", "ExchangeKVAgentInfo", "StreamTokenIDs", "StreamStrOutputs",
)  # fmt: skip
_UNTRACED_PATHS = ("/health", "/metrics")
# FastAPI(telemetry=...): HTTP server spans only (no per-dependency spans, no OTel metrics or logs)
HTTP_TELEMETRY = {
    "operation_spans": False,
    "metrics": False,
    "logs": False,
    "exclude": lambda scope: scope.get("path") in _UNTRACED_PATHS,
}


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="send OpenTelemetry traces to this OTLP/gRPC collector, e.g. http://otel-collector:4317 "
        "(needs pdserve[tracing]; OTEL_* variables tune the exporter)",
    )


def configure_tracing(endpoint: str | None, service: str) -> None:
    """Trace this process to ``endpoint`` as service ``pdserve-<service>``; no-op when None.

    Installs a ``TracerProvider`` with a batching OTLP/gRPC exporter (flushed at exit) and patches
    ``grpc.aio`` so that channels and servers created from now on propagate ``traceparent``.

    Raises:
        ImportError: the ``tracing`` extra is not installed (with how to install it).
    """
    global _tracer
    if not endpoint:
        return
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.instrumentation.grpc import (
            GrpcAioInstrumentorClient,
            GrpcAioInstrumentorServer,
            filters,
        )
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ImportError(f"--otlp-traces-endpoint needs pip install 'pdserve[tracing]' ({e})") from e
    provider = TracerProvider(resource=Resource.create({"service.name": f"pdserve-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)
    traced = filters.all_of(
        filters.service_prefix("pdserve."),
        filters.negate(filters.any_of(*map(filters.method_name, _UNTRACED_METHODS))),
    )
    GrpcAioInstrumentorServer(filter_=traced).instrument()
    GrpcAioInstrumentorClient(filter_=traced).instrument()
    _tracer = trace.get_tracer("pdserve")
    logger.info("tracing to %s as pdserve-%s", endpoint, service)


def enabled() -> bool:
    return _tracer is not None


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def request_phases(req: Req, role: str) -> list[tuple[str, float, float]]:
    """``(name, start, end)`` (time.time() seconds) of the phases ``req`` went through on a scheduler
    of ``role``; a phase it never left ends when the request ended.

    mixed: queue, prefill, decode. decode: queue, remote_prefill (a prefill worker computes and
    writes the prompt's KV into this worker's pages), decode. prefill: queue, prefill, kv_transfer.
    """
    names = {"mixed": ("queue", "prefill", "decode"), "decode": ("queue", "remote_prefill", "decode")}
    names = names.get(role, ("queue", "prefill", "kv_transfer"))
    marks = [req.arrival_time, req.admit_time, req.first_token_time]
    phases = []
    for i, name in enumerate(names):
        start = marks[i]
        if not start:
            break
        end = next((t for t in marks[i + 1 :] if t), 0.0) or req.finish_time
        phases.append((name, start, max(start, end)))
    return phases


def start_request_span(req: Req, role: str) -> None:
    """Open ``<role>.request`` for ``req`` as a child of the current span (the RPC that brought it);
    kept in ``req.span``. A no-op without tracing."""
    if _tracer is None:
        return
    req.span = _tracer.start_span(
        f"{role}.request", start_time=_ns(req.arrival_time), attributes={"pdserve.rid": req.rid}
    )


def end_request_span(req: Req, role: str) -> None:
    """Add ``req``'s phase spans to its request span and end it (the scheduler's ``on_request_end``)."""
    span, req.span = req.span, None
    if span is None:
        return
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    context = trace.set_span_in_context(span)
    for name, start, end in request_phases(req, role):
        _tracer.start_span(name, context=context, start_time=_ns(start)).end(end_time=_ns(end))
    span.set_attributes(
        {
            "pdserve.prompt_tokens": len(req.origin_input_ids),
            "pdserve.cached_tokens": req.cached_tokens,
            "pdserve.output_tokens": len(req.output_ids),
            "pdserve.finish_reason": req.finish_reason.value if req.finish_reason else "",
        }
    )
    if req.finish_reason == FinishReason.ERROR:
        span.set_status(Status(StatusCode.ERROR, req.error))
    span.end(end_time=_ns(req.finish_time))


@contextlib.contextmanager
def request_context(req: Req) -> Iterator[None]:
    """Make ``req``'s request span current (RPCs made inside are its children)."""
    span = req.span
    if span is None:
        yield
        return
    from opentelemetry import trace

    with trace.use_span(span, end_on_exit=False):
        yield


def traceparent(req: Req) -> str:
    """The W3C ``traceparent`` of ``req``'s request span ("" without one)."""
    span = req.span
    if span is None:
        return ""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def tag_current_span(rid: str) -> None:
    """Put ``rid`` on the current span (the gateway's HTTP span); a no-op without tracing."""
    if _tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().set_attribute("pdserve.rid", rid)


def record_span(name: str, parent_traceparent: str, start: float, end: float, rid: str) -> None:
    """A finished span ``name`` of request ``rid`` from ``start`` to ``end`` (time.time() seconds),
    child of the span that ``parent_traceparent`` names; a no-op without tracing or without a parent."""
    if _tracer is None or not parent_traceparent:
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract({"traceparent": parent_traceparent})
    span = _tracer.start_span(name, context=context, start_time=_ns(start), attributes={"pdserve.rid": rid})
    span.end(end_time=_ns(end))
