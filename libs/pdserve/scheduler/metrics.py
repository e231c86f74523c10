"""Prometheus metrics of one scheduler process (its ``--metrics-port``, and ``GetMetrics`` for the
gateway's merged view). Names and their vLLM equivalents: the metrics table of docs/operations.md."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.observability.metrics_http import exposition, labelled

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 30)
# request lengths in tokens, 1-2-5 steps (vLLM's build_1_2_5_buckets)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))


class SchedulerMetrics:
    """Gauges, counters and histograms of a scheduler, in a private registry.

    ``exposed`` shows them with a ``model_name`` label (the served model name); the gateway adds
    ``role`` and ``worker`` labels when it merges every worker's text.
    """

    def __init__(self, role: str, model_name: str = "") -> None:
        self.role = role
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        self.exposed = labelled(r, model_name=model_name)
        self.num_running = Gauge("pdserve:num_running_reqs", "Requests admitted and not finished", registry=r)
        self.num_queue = Gauge("pdserve:num_queue_reqs", "Requests waiting for admission", registry=r)
        self.kv_pages_used = Gauge("pdserve:kv_pages_used", "KV pages owned by requests", registry=r)
        self.kv_pages_free = Gauge("pdserve:kv_pages_free", "KV pages on the free list", registry=r)
        self.kv_pages_total = Gauge("pdserve:kv_pages_total", "Usable KV pages of the pool", registry=r)
        self.kv_pages_cached = Gauge(
            "pdserve:kv_pages_cached", "KV pages held by the radix cache", registry=r
        )
        self.kv_cache_usage = Gauge(
            "pdserve:kv_cache_usage_perc",
            "KV pages owned by requests / usable pages (0-1; pages only the radix cache holds are free)",
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "pdserve:kv_transfer_bytes", "KV bytes moved between prefill and decode over NIXL", registry=r
        )
        self.kv_transfer_seconds = Histogram(
            "pdserve:kv_transfer_seconds",
            "Prefill role: from a request's first token to the end of its KV write (what TTFT waits for)",
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Tokens generated", registry=r)
        self.prefix_cache_queries = Counter(
            "pdserve:prefix_cache_queries", "Prompt tokens looked up in the radix cache", registry=r
        )
        self.prefix_cache_hit_tokens = Counter(
            "pdserve:prefix_cache_hit_tokens", "Prompt tokens found in the radix cache", registry=r
        )
        self.request_prompt_tokens = Histogram(
            "pdserve:request_prompt_tokens",
            "Prompt length of each request",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "pdserve:request_generation_tokens",
            "Tokens generated per request, at its end; decode and mixed roles",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.finished = Counter(
            "pdserve:requests_finished",
            "Requests that ended, by finish_reason (stop, length, abort, error); decode and mixed roles",
            ["finish_reason"],
            registry=r,
        )
        self.tp_state_checks = Counter(
            "pdserve:tp_state_checks",
            "Steps after which every TP rank's scheduler state digest was compared and found equal",
            registry=r,
        )
        self.rejected = Counter(
            "pdserve:requests_rejected",
            "Requests refused for overload: queue_full (at arrival) or queue_time (waited too long)",
            ["reason"],
            registry=r,
        )
        self.retracted = Counter(
            "pdserve:num_retracted_reqs", "Requests retracted for lack of KV", registry=r
        )
        self.grammar_requests = Counter(
            "pdserve:grammar_requests",
            "Constrained requests, by whether their compiled grammar came from the cache (hit, miss)",
            ["cache"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "pdserve:inter_token_latency_seconds", "Gap between tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "pdserve:e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "pdserve:queue_time_seconds", "Arrival to admission", buckets=_LATENCY_BUCKETS, registry=r
        )

    def text(self) -> str:
        """Prometheus text exposition of this registry, ``model_name`` labelled."""
        return exposition(self.exposed)
