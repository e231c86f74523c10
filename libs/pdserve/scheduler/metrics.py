"""Prometheus metrics of one scheduler process (its ``--metrics-port``, and ``GetMetrics`` for the
gateway's merged view). Names and their vLLM equivalents: the metrics table of docs/operations.md."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.mem_cache.kv_tier import KVTier
from pdserve.mem_cache.swa_pool import SWAPageMap
from pdserve.observability.metrics_http import exposition, labelled
from pdserve.scheduler.req import Req

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 30)
# request lengths in tokens, 1-2-5 steps (vLLM's build_1_2_5_buckets)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))


@dataclass(frozen=True, slots=True)
class SchedulerLoad:
    """A scheduler's load and limits at one moment (``GetLoad``, and the gauges below).

    Attributes (named as ``pdserve.v1.LoadInfo``'s fields):
        num_running_reqs: requests admitted and not finished (extending, decoding, or waiting for KV).
        num_queue_reqs: requests waiting for admission (their grammar's compile included).
        kv_pages_used / kv_pages_free / kv_pages_cached / kv_pages_total: the KV pool, in pages
            (owned by requests, on the free list, held only by the radix cache, usable in all).
        page_size: tokens per page.
        request_capacity / max_queued_requests: the overload limits (``overload``).
        lora_resident: the LoRA adapters in the worker's slots, least recently used first.
    """

    num_running_reqs: int
    num_queue_reqs: int
    kv_pages_used: int
    kv_pages_free: int
    kv_pages_cached: int
    kv_pages_total: int
    page_size: int
    request_capacity: int
    max_queued_requests: int
    lora_resident: tuple[str, ...] = ()


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
        # speculative decoding (vLLM's names): verify rows with drafts, their drafts, the drafts kept
        self.spec_decode_num_drafts = Counter(
            "pdserve:spec_decode_num_drafts", "Speculative verify steps of a request with drafts", registry=r
        )
        self.spec_decode_num_draft_tokens = Counter(
            "pdserve:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r
        )
        self.spec_decode_num_accepted_tokens = Counter(
            "pdserve:spec_decode_num_accepted_tokens", "Draft tokens accepted by verification", registry=r
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

    def set_load(self, load: SchedulerLoad) -> None:
        self.num_running.set(load.num_running_reqs)
        self.num_queue.set(load.num_queue_reqs)
        self.kv_pages_used.set(load.kv_pages_used)
        self.kv_pages_free.set(load.kv_pages_free)
        self.kv_pages_cached.set(load.kv_pages_cached)
        self.kv_pages_total.set(load.kv_pages_total)
        total = load.kv_pages_total
        self.kv_cache_usage.set(load.kv_pages_used / total if total else 0.0)

    def observe_token(self, req: Req, now: float) -> None:
        """A token of ``req`` comes at ``now`` (before it is appended): its TTFT, or the gap to the last."""
        if req.first_token_time == 0.0:
            self.ttft.observe(now - req.arrival_time)
        else:
            self.itl.observe(now - req.last_token_time)

    def observe_end(self, req: Req, finished_here: bool) -> None:
        """``req`` ended (``finish_time`` set); ``finished_here``: this worker owns its finish (not a
        prefill worker, which hands requests on)."""
        if req.first_token_time:
            self.e2e.observe(req.finish_time - req.arrival_time)
        if finished_here:
            self.finished.labels(finish_reason=req.finish_reason.value).inc()
            self.request_generation_tokens.observe(len(req.output_ids))

    def watch_local_pages(self, swa: SWAPageMap) -> None:
        """Gauges of an SWA pool's local pages (its sliding-window layers' KV), read at each scrape:
        those running requests read (inside their windows), those held only by the radix cache
        (evictable), free, and all of them."""
        r = self.registry
        used = Gauge("pdserve:swa_pages_used", "Local KV pages running requests read", registry=r)
        cached = Gauge("pdserve:swa_pages_cached", "Local KV pages held by the radix cache only", registry=r)
        free = Gauge("pdserve:swa_pages_free", "Local KV pages no page holds", registry=r)
        total = Gauge("pdserve:swa_pages_total", "Local KV pages of the sliding-window layers", registry=r)
        used.set_function(swa.used_pages)
        free.set_function(swa.available_size)
        cached.set_function(lambda: swa.held_pages() - swa.used_pages())
        total.set_function(lambda: swa.num_pages)

    def watch_tier(self, tier: KVTier) -> None:
        """The KV tier's page gauges (read at each scrape), hit counter and load-back histogram
        (``observe_load_back``)."""
        r = self.registry
        used = Gauge("pdserve:kv_tier_pages_used", "KV tier pages holding evicted radix-cache KV", registry=r)
        total = Gauge("pdserve:kv_tier_pages_total", "KV tier pages (--kv-tier-memory)", registry=r)
        used.set_function(tier.used_pages)
        total.set_function(lambda: tier.num_pages)
        self.kv_tier_hit_tokens = Counter(
            "pdserve:kv_tier_hit_tokens", "Prompt tokens loaded back from the KV tier", registry=r
        )
        self.kv_tier_load_seconds = Histogram(
            "pdserve:kv_tier_load_seconds",
            "Time of one load-back from the KV tier (pool pages allocated, then copied), on the loop thread",
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )

    def observe_load_back(self, num_tokens: int, seconds: float) -> None:
        """``num_tokens`` of a prompt's prefix came back from the KV tier in ``seconds``."""
        self.kv_tier_hit_tokens.inc(num_tokens)
        self.kv_tier_load_seconds.observe(seconds)

    def text(self) -> str:
        """Prometheus text exposition of this registry, ``model_name`` labelled."""
        return exposition(self.exposed)
