"""The detokenizer's Prometheus metrics, in a registry of its own (one per process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.observability.metrics_http import exposition, labelled


class DetokenizerMetrics:
    """Counters and gauges the detokenizer exports through ``GetMetrics``.

    ``active_streams`` counts requests whose output stream is open here (one decode state per rid);
    ``scheduler_streams`` counts open StreamTokenIDs calls (one per decode-scheduler). Every sample
    is exposed with a ``model_name`` label.
    """

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        self.active_streams = Gauge(
            "pdserve:detokenizer_active_streams", "requests with a live decode state", registry=r
        )
        self.scheduler_streams = Gauge(
            "pdserve:detokenizer_scheduler_streams", "open StreamTokenIDs calls", registry=r
        )
        self.tokens = Counter("pdserve:detokenizer_tokens", "token ids turned into text", registry=r)
        self.stop_string_matches = Counter(
            "pdserve:detokenizer_stop_string_matches", "requests ended by a stop string", registry=r
        )
        self.batch_seconds = Histogram(
            "pdserve:detokenizer_batch_seconds",
            "time to turn one BatchTokenIDOutput into BatchStrOutputs",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25),
            registry=r,
        )

    def render(self) -> str:
        """Prometheus text exposition of this registry, ``model_name`` labelled."""
        return exposition(labelled(self.registry, model_name=self.model_name))
