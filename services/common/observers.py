"""What a scheduler process runs beside its loop for operators: its ``/metrics`` endpoint
(``--metrics-port``: the scheduler's metrics and the process's own, ``model_name`` labelled) and its
periodic stats line (``--stats-interval``)."""

from __future__ import annotations

import argparse
import asyncio

from prometheus_client import REGISTRY

from pdserve.observability.metrics_http import labelled, serve_metrics
from pdserve.observability.stats_log import start_stats_logger
from pdserve.scheduler.scheduler import Scheduler


class SchedulerObservers:
    """Started with the worker (its flags ``args``), ``close``d when it stops.

    Raises:
        OSError: ``--metrics-port`` cannot be bound.
    """

    def __init__(self, args: argparse.Namespace, scheduler: Scheduler) -> None:
        metrics = scheduler.metrics
        exposed = labelled(metrics.registry, REGISTRY, model_name=metrics.model_name)
        self.server = serve_metrics(args, args.host, exposed)
        self._stop = asyncio.Event()
        self._stats = start_stats_logger(metrics.registry, args.stats_interval, self._stop)

    async def close(self) -> None:
        self._stop.set()
        if self._stats is not None:
            await self._stats
        if self.server is not None:
            self.server.close()
