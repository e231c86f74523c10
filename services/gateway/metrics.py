"""The gateway's Prometheus metrics, and /metrics: its own plus every backend's, labelled by role/worker.

Own metrics (one ``CollectorRegistry`` per gateway): request counts by endpoint and status, and the
latencies clients see, measured at the gateway: ``pdserve:time_to_first_token_seconds`` (arrival to
first token of a choice), ``pdserve:inter_token_latency_seconds`` (per token, between consecutive
outputs of a choice), ``pdserve:e2e_request_latency_seconds`` (arrival to last output).

A scrape gathers every scheduler's and detokenizer's ``GetMetrics`` text, parses it with
``prometheus_client.parser``, adds ``role`` and ``worker`` labels to each sample (the gateway's
own samples get role="gateway"), merges families of the same name and renders the result from a
fresh registry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.observability.metrics_http import labelled
from pdserve.services.gateway.routing.workers import WorkerPool
from pdserve.services.gateway.transport.backend_clients import BackendClients

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    """Counters and histograms of one gateway replica, in a private registry (its own
    ``--metrics-port`` shows them with a ``model_name`` label; the merged view adds it too)."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve:gateway_requests", "Requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.migrations = Counter(
            "pdserve:gateway_migrations",
            "Requests resubmitted to another decode worker as a continuation, by why their worker was left",
            ["reason"],
            registry=r,
        )
        self.in_flight = Gauge("pdserve:gateway_in_flight_requests", "Client requests in flight", registry=r)
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "pdserve:inter_token_latency_seconds", "Gap between tokens", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "pdserve:e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS, registry=r
        )


class RequestCountMiddleware:
    """ASGI middleware counting HTTP responses by endpoint (known paths, else "other") and status."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, endpoints: Iterable[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"

        async def send_counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_counting)


class _Families:
    """A collector that yields already-built metric families (one fresh registry per scrape)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def render_merged(own: GatewayMetrics, own_worker: str, backends: Iterable[tuple[str, str, str]]) -> bytes:
    """Prometheus text of the gateway's metrics plus ``backends`` = ``(role, worker, text)`` triples.

    Families of one name are merged across workers; a family whose type disagrees with the first
    one seen under its name is dropped (and logged).
    """
    merged: dict[str, Metric] = {}

    def add(role: str, worker: str, families: Iterable[Metric]) -> None:
        for fam in families:
            target = merged.get(fam.name)
            if target is None:
                target = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            elif target.type != fam.type:
                logger.warning(
                    "metric %s is a %s on %s but a %s elsewhere", fam.name, fam.type, worker, target.type
                )
                continue
            target.samples.extend(
                s._replace(labels={**s.labels, "role": role, "worker": worker})
                for s in fam.samples
                if not s.name.endswith("_created")
            )

    add("gateway", own_worker, labelled(own.registry, model_name=own.model_name).collect())
    for role, worker, text in backends:
        try:
            add(role, worker, text_string_to_metric_families(text))
        except ValueError as e:
            logger.warning("unparsable metrics from %s %s: %s", role, worker, e)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([m for m in merged.values() if m.samples]))
    return generate_latest(registry)


async def scrape_backends(clients: BackendClients, pools: Iterable[WorkerPool]) -> list[tuple[str, str, str]]:
    """``GetMetrics`` of every worker of ``pools`` (schedulers, detokenizers); failures are skipped."""
    workers = [(pool.role, w.address) for pool in pools for w in pool.workers]
    results = await asyncio.gather(*(clients.metrics(role, a) for role, a in workers), return_exceptions=True)
    for (role, address), r in zip(workers, results, strict=True):
        if isinstance(r, BaseException):
            logger.debug("GetMetrics %s %s failed: %s", role, address, r)
    return [r for r in results if not isinstance(r, BaseException)]
