"""A scheduler worker's liveness: a step heartbeat behind its grpc.health.v1 status.

The scheduler loop beats once per iteration (an idle loop wakes every ``IDLE_POLL_S``, a busy one
once per step). ``StepWatchdog``, a task on the same event loop, reports the whole server
NOT_SERVING once the last beat is older than ``--watchdog-timeout``: a forward that never returns
(SGLang's watchdog crashes the process instead; we report it, and whoever supervises acts). A
stuck event loop, or a stopped process, cannot answer health checks at all, so its checks time out.
Either way the check fails: the gateway takes the worker out of routing, ``pdserve launch``
SIGKILLs and restarts it, and the Helm chart's liveness probe (grpc.health.v1 on service "") has the
kubelet restart its container. Beats that resume (a slow step, not a stuck one) report SERVING again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class Heartbeat:
    """The time of the scheduler loop's last iteration (``time.monotonic()``)."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def beat(self) -> None:
        self.last = time.monotonic()

    def age(self) -> float:
        """Seconds since the last beat."""
        return time.monotonic() - self.last


class StepWatchdog:
    """Turns a stale ``Heartbeat`` into NOT_SERVING, and a fresh one back into SERVING.

    Args:
        heartbeat: beaten by the scheduler loop.
        set_serving: ``GrpcServer.set_serving`` (every service name and "").
        timeout: seconds without a beat that mean the loop is stuck (> 0).
    """

    def __init__(
        self, heartbeat: Heartbeat, set_serving: Callable[[bool], Awaitable[None]], timeout: float
    ) -> None:
        self.heartbeat = heartbeat
        self.set_serving = set_serving
        self.timeout = timeout
        self.stuck = False

    async def check(self) -> None:
        """Compare the heartbeat's age with the timeout once; report a change of state."""
        age = self.heartbeat.age()
        if not self.stuck and age > self.timeout:
            self.stuck = True
            logger.error(
                "the scheduler loop has not completed a step for %.0f s (watchdog timeout %g s): "
                "reporting NOT_SERVING so that this worker is restarted",
                age,
                self.timeout,
            )
            await self.set_serving(False)
        elif self.stuck and age <= self.timeout:
            self.stuck = False
            logger.warning("the scheduler loop is stepping again: reporting SERVING")
            await self.set_serving(True)

    async def run(self, stop: asyncio.Event) -> None:
        """Check every ``min(1, timeout / 4)`` seconds until ``stop`` is set."""
        interval = min(1.0, self.timeout / 4)
        while not stop.is_set():
            await self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)


def start_watchdog(
    heartbeat: Heartbeat, set_serving: Callable[[bool], Awaitable[None]], timeout: float, stop: asyncio.Event
) -> asyncio.Task | None:
    """Run a ``StepWatchdog`` until ``stop`` (None when ``timeout`` is 0: no watchdog)."""
    if not timeout:
        return None
    return asyncio.get_running_loop().create_task(StepWatchdog(heartbeat, set_serving, timeout).run(stop))
