"""Graceful stop of a scheduler worker (SIGTERM): stop admitting, let what it holds finish, then exit.

``drain`` reports the worker's own gRPC service NOT_SERVING while the server as a whole ("") stays
SERVING, so a gateway stops routing new requests to it without treating it as dead (which would end
the requests it still holds), and the Kubernetes readiness probe (on the service name) takes it out
of its Service while the liveness probe (on "") keeps it alive. New Generate / Prefill calls are
refused with UNAVAILABLE (a decode worker retries a refused prefill on another prefill worker).
Running requests finish; a prefill worker finishes the prefills it owes and their KV writes. What
is still there after ``--drain-timeout`` seconds is aborted with a clear error, which reaches the
client as the request's finish.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Protocol

from pdserve.rpc.server import GrpcServer
from pdserve.scheduler.scheduler import Scheduler
from pdserve.services.common.scheduler_loop import SchedulerLoop

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0
_ABORT_FLUSH_S = 2.0  # after the timeout: time for the aborts to go out as outputs


class Drainable(Protocol):
    """What ``drain`` needs of a scheduler servicer."""

    scheduler: Scheduler
    loop: SchedulerLoop
    draining: bool

    def busy(self) -> bool:
        """Requests (or their KV writes) still in flight."""

    def abort(self, rid: str, reason: str) -> bool: ...


def add_drain_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM, seconds the requests this worker holds get to finish (new ones are refused) "
        "before they are aborted",
    )


async def drain(server: GrpcServer, servicer: Drainable, timeout: float) -> None:
    """Refuse new requests and wait up to ``timeout`` s for ``servicer`` to finish what it holds;
    abort the rest (reason "worker shutting down"). Returns with nothing in flight, or after the
    aborts had ``_ABORT_FLUSH_S`` to go out."""
    servicer.draining = True
    await server.set_draining()
    held = len(servicer.scheduler.held_rids())
    logger.info("draining: new requests refused, %d held get up to %.0f s to finish", held, timeout)
    start = time.monotonic()
    while servicer.busy() and time.monotonic() - start < timeout:
        await asyncio.sleep(0.05)
    if servicer.busy():
        left = servicer.scheduler.held_rids()
        logger.warning("drain timeout (%.0f s): aborting %d requests", timeout, len(left))
        for rid in left:
            servicer.abort(rid, f"worker shutting down: not finished within its {timeout:g} s drain")
        servicer.loop.wake()
        flush_until = time.monotonic() + _ABORT_FLUSH_S
        while servicer.busy() and time.monotonic() < flush_until:
            await asyncio.sleep(0.05)
    logger.info("drained in %.1f s", time.monotonic() - start)
