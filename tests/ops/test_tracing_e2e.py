"""OpenTelemetry traces of real requests through every service, received over OTLP/gRPC."""

from __future__ import annotations

import re
import secrets

from tests.ops.conftest import SERVED_NAMES, OpsStack
from tests.ops.otlp_receiver import Span

SERVICES = ("gateway", "tokenizer", "decode", "prefill", "detokenizer")
# (service, span name) that every PD request's trace holds, beyond the gRPC spans
PHASES = {
    ("decode", "decode.request"), ("decode", "queue"), ("decode", "remote_prefill"), ("decode", "decode"),
    ("prefill", "prefill.request"), ("prefill", "queue"), ("prefill", "prefill"), ("prefill", "kv_transfer"),
    ("detokenizer", "detokenize"),
}  # fmt: skip


def trace_of(spans: list[Span], rid: str) -> list[Span]:
    """Every span of the trace whose gateway HTTP span carries ``rid``."""
    roots = [s for s in spans if s.service == "pdserve-gateway" and s.attributes.get("pdserve.rid") == rid]
    if not roots:
        return []
    return [s for s in spans if s.trace_id == roots[0].trace_id]


def complete(spans: list[Span], rid: str) -> bool:
    names = {(s.service.removeprefix("pdserve-"), s.name) for s in trace_of(spans, rid)}
    return names >= PHASES


def one(trace: list[Span], service: str, name: str) -> Span:
    found = [s for s in trace if s.service == f"pdserve-{service}" and s.name == name]
    assert len(found) == 1, f"{service} {name}: {found}"
    return found[0]


def check_tree(trace: list[Span], rid: str) -> None:
    """One tree across the five services, each span where the request's path puts it."""
    by_id = {s.span_id: s for s in trace}
    assert {s.service.removeprefix("pdserve-") for s in trace} == set(SERVICES)
    root = one(trace, "gateway", "POST /v1/chat/completions")
    for span in trace:  # every span but the HTTP one has its parent in this trace
        if span is not root:
            assert span.parent_id in by_id, f"{span.service} {span.name} is not parented in the trace"
        assert span.start <= span.end

    def parent(span: Span) -> Span:
        return by_id[span.parent_id]

    def rpc_client(server_service: str, method: str) -> Span:
        """The client span of ``method``, parent of its server span in ``server_service``."""
        client = parent(one(trace, server_service, method))
        assert client.name == method and client.service != f"pdserve-{server_service}"
        return client

    assert parent(rpc_client("tokenizer", "/pdserve.v1.Tokenizer/Tokenize")) is root
    assert parent(rpc_client("decode", "/pdserve.v1.DecodeScheduler/Generate")) is root
    decode_req = one(trace, "decode", "decode.request")
    # under the Generate server span, whose parent is the gateway's client span under the HTTP span
    assert parent(decode_req) is one(trace, "decode", "/pdserve.v1.DecodeScheduler/Generate")
    assert re.fullmatch(
        rf"{re.escape(rid)}-0\.[0-9a-f]{{8}}\.[0-9a-f]+", decode_req.attributes["pdserve.rid"]
    )  # backend_rid
    prefill_req = one(trace, "prefill", "prefill.request")
    prefill_call = parent(prefill_req)
    assert prefill_call.name == "/pdserve.v1.PrefillScheduler/Prefill"
    assert parent(parent(prefill_call)) is decode_req  # server span, client span, decode.request
    assert parent(one(trace, "detokenizer", "detokenize")) is decode_req
    # the phases tile their request span, in order
    for request, phases in (
        (decode_req, ("queue", "remote_prefill", "decode")),
        (prefill_req, ("queue", "prefill", "kv_transfer")),
    ):
        spans = [one(trace, request.service.removeprefix("pdserve-"), name) for name in phases]
        assert all(parent(s) is request for s in spans)
        assert spans[0].start == request.start and spans[-1].end == request.end
        assert all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False))
    # the prefill worker's work starts inside the decode worker's wait for it and its compute ends
    # there too (the end of the KV transfer is seen by each side on its own, in either order)
    remote = one(trace, "decode", "remote_prefill")
    compute = one(trace, "prefill", "prefill")
    assert remote.start <= prefill_req.start and compute.end <= remote.end


def chat(ops: OpsStack, rid: str, **headers: str) -> None:
    resp = ops.client(**{"X-Request-Id": rid, **headers}).chat.completions.create(
        model=SERVED_NAMES[0],
        messages=[{"role": "user", "content": f"Name a colour. ({rid})"}],
        temperature=0,
        max_tokens=8,
    )
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_one_trace_per_request_across_every_service(ops_stack: OpsStack) -> None:
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    traced, fresh = f"ops-trace-{secrets.token_hex(4)}", f"ops-trace-{secrets.token_hex(4)}"
    chat(ops_stack, traced, traceparent=f"00-{client_trace}-{client_span}-01")
    chat(ops_stack, fresh)
    spans = ops_stack.receiver.wait_for(lambda s: complete(s, traced) and complete(s, fresh))

    for rid in (traced, fresh):
        check_tree(trace_of(spans, rid), rid)

    # the client's traceparent is honoured: same trace id, the HTTP span is its child
    traced_root = one(trace_of(spans, traced), "gateway", "POST /v1/chat/completions")
    assert (traced_root.trace_id, traced_root.parent_id) == (client_trace, client_span)
    fresh_root = one(trace_of(spans, fresh), "gateway", "POST /v1/chat/completions")
    assert fresh_root.parent_id == "" and fresh_root.trace_id != client_trace


def test_probes_are_not_traced(ops_stack: OpsStack) -> None:
    """Health checks, load polls, metrics scrapes and the output streams make no spans."""
    spans = ops_stack.receiver.wait_for(lambda s: bool(s))
    methods = {s.name.rsplit("/", 1)[-1] for s in spans}
    assert not methods & {"Check", "Watch", "GetLoad", "GetMetrics", "StreamTokenIDs", "StreamStrOutputs"}
    assert not [s for s in spans if s.name in ("GET /health", "GET /metrics")]
