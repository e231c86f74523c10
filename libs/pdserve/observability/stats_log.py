"""The periodic stats line of a scheduler (as vLLM and SGLang print one), read from its metrics:

    stats: running 12, queued 3, KV usage 41.2%, prompt 812.0 tok/s, generation 301.5 tok/s,
    prefix cache hit rate 63.0%

Rates and the hit rate are over the last interval; an idle scheduler with nothing to report stays
quiet. In JSON logs the numbers are fields of the line too (``running``, ``queued``, ``kv_usage``,
``prompt_tokens_per_s``, ``generation_tokens_per_s``, ``prefix_cache_hit_rate``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time

from prometheus_client import CollectorRegistry

logger = logging.getLogger("pdserve.stats")

_COUNTERS = {
    "prompt": "pdserve:prompt_tokens_total",
    "generation": "pdserve:generation_tokens_total",
    "queries": "pdserve:prefix_cache_queries_total",
    "hits": "pdserve:prefix_cache_hit_tokens_total",
}


def add_stats_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stats-interval",
        type=float,
        default=10.0,
        help="seconds between stats log lines (running, queued, KV usage, tok/s, cache hit rate); 0 = none",
    )


class StatsLogger:
    """Builds the stats line of a scheduler from its ``SchedulerMetrics.registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._last = self._counters()
        self._last_time = time.monotonic()

    def _value(self, name: str) -> float:
        return self.registry.get_sample_value(name) or 0.0

    def _counters(self) -> dict[str, float]:
        return {key: self._value(name) for key, name in _COUNTERS.items()}

    def sample(self) -> dict[str, float] | None:
        """The numbers of the interval since the last call; None when the scheduler was idle."""
        now, counters = time.monotonic(), self._counters()
        delta = {key: counters[key] - self._last[key] for key in counters}
        elapsed = max(now - self._last_time, 1e-9)
        self._last, self._last_time = counters, now
        running = self._value("pdserve:num_running_reqs")
        queued = self._value("pdserve:num_queue_reqs")
        if not (running or queued or any(delta.values())):
            return None
        return {
            "running": int(running),
            "queued": int(queued),
            "kv_usage": self._value("pdserve:kv_cache_usage_perc"),
            "prompt_tokens_per_s": delta["prompt"] / elapsed,
            "generation_tokens_per_s": delta["generation"] / elapsed,
            "prefix_cache_hit_rate": delta["hits"] / delta["queries"] if delta["queries"] else 0.0,
        }

    def log(self) -> None:
        stats = self.sample()
        if stats is None:
            return
        logger.info(
            "stats: running %d, queued %d, KV usage %.1f%%, prompt %.1f tok/s, generation %.1f tok/s, "
            "prefix cache hit rate %.1f%%",
            stats["running"], stats["queued"], 100 * stats["kv_usage"], stats["prompt_tokens_per_s"],
            stats["generation_tokens_per_s"], 100 * stats["prefix_cache_hit_rate"],
            extra=stats,
        )  # fmt: skip

    async def run(self, interval: float, stop: asyncio.Event) -> None:
        """Log every ``interval`` seconds until ``stop`` is set."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            self.log()


def start_stats_logger(
    registry: CollectorRegistry, interval: float, stop: asyncio.Event
) -> asyncio.Task | None:
    """A task logging the stats line of ``registry`` every ``interval`` s (None for 0: no line)."""
    if interval <= 0:
        return None
    return asyncio.get_running_loop().create_task(StatsLogger(registry).run(interval, stop))
