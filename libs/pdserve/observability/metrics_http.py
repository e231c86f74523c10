"""Each service's own Prometheus endpoint: ``GET /metrics`` on ``--metrics-port`` (prometheus-client's
``start_http_server``, a thread of its own), every sample labelled with ``model_name``.

A Prometheus (or the chart's PodMonitor) scrapes every pod directly, so a metric never depends on a
gateway being up, and N gateways do not multiply it. The gateway's own ``/metrics`` on its HTTP port
still merges every backend's text as a convenience (``services.gateway.metrics.render_merged``).
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest, start_http_server
from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)

# prometheus-client adds a ``<name>_created`` sample to every counter and histogram, which its text
# format writes as a gauge family of its own; Prometheus has no use for them (vLLM turns them off too).
disable_created_metrics()


def add_metrics_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve this process's Prometheus metrics at http://<host>:<port>/metrics (default: none)",
    )


class ConstLabels:
    """A collector yielding ``registry``'s families with ``labels`` added to every sample.

    prometheus-client has no constant labels; every family ``collect`` returns is built anew, so
    they are labelled in place.
    """

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s._replace(labels={**s.labels, **self.labels}) for s in family.samples]
            yield family


def labelled(*registries: CollectorRegistry, model_name: str) -> CollectorRegistry:
    """A registry exposing every metric of ``registries`` with ``model_name=<model_name>`` on every
    sample (``prometheus_client.REGISTRY`` adds the process's own: CPU, memory, RPC counts)."""
    exposed = CollectorRegistry(auto_describe=False)
    for registry in registries:
        exposed.register(ConstLabels(registry, {"model_name": model_name}))
    return exposed


def exposition(registry: CollectorRegistry) -> str:
    """Prometheus text of ``registry`` (what ``GetMetrics`` hands the gateway)."""
    return generate_latest(registry).decode()


class MetricsServer:
    """``GET /metrics`` of ``registry`` on ``host:port`` until ``close``.

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = self._server.server_port
        logger.info("metrics at http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(args: argparse.Namespace, host: str, registry: CollectorRegistry) -> MetricsServer | None:
    """The metrics server of ``--metrics-port`` on ``host``, or None without the flag."""
    if args.metrics_port is None:
        return None
    return MetricsServer(host, args.metrics_port, registry)
