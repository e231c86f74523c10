"""Watch another process's grpc.health.v1 status: has it answered SERVING recently?

A process that is stopped (SIGSTOP), whose event loop is stuck, or whose scheduler step is stuck
(it then reports NOT_SERVING, see ``pdserve.services.common.liveness``) stops answering SERVING.
``HealthWatch`` polls ``Check`` and sets ``silent`` once no SERVING answer came for ``dead_after``
seconds; it clears it when one comes again. Used by the launcher (a hung child is killed and
restarted) and by decode workers (a prefill call to a hung prefill worker is given up and retried
on another one).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc import tls
from pdserve.rpc.server import GRPC_OPTIONS


class HealthWatch:
    """Polls ``Check(service="")`` on ``channel`` from ``start()`` until ``close()``.

    Args:
        channel: a channel to the watched process (the caller's, shared with its other calls).
        dead_after: seconds without a SERVING answer after which ``silent`` is set.
        interval: seconds between checks (default ``min(1, dead_after / 4)``).

    Attributes:
        silent: set while the process has not answered SERVING for ``dead_after`` seconds.
        last_serving: ``time.monotonic()`` of the last SERVING answer (or of ``start()``).

    Each check may take up to ``dead_after / 2`` seconds, so a silent process is noticed between
    ``dead_after`` and about ``1.5 * dead_after + interval`` seconds after its last answer.
    """

    def __init__(self, channel: grpc.aio.Channel, dead_after: float, interval: float | None = None) -> None:
        if dead_after <= 0:
            raise ValueError(f"dead_after must be positive, got {dead_after}")
        self.dead_after = dead_after
        self.interval = interval if interval is not None else min(1.0, dead_after / 4)
        self.silent = asyncio.Event()
        self.last_serving = time.monotonic()
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start polling (idempotent); the silence is counted from now."""
        if self._task is None:
            self.last_serving = time.monotonic()
            self._task = asyncio.get_running_loop().create_task(self._poll())

    def silent_for(self) -> float:
        """Seconds since the last SERVING answer."""
        return time.monotonic() - self.last_serving

    async def wait_silent(self, since: float | None = None) -> float:
        """Return once the process is silent (at once if it already is); returns ``silent_for()``.

        With ``since`` (a ``time.monotonic()`` instant, e.g. when a call to the process began), the
        silence counts from the later of its last SERVING answer and ``since``: a call made just after
        the process came back from a restart (its health checks were still failing a moment ago, or
        the channel is still in its reconnect backoff) gets the whole ``dead_after`` for the next
        SERVING answer, instead of being given up at once.
        """
        self.start()
        while True:
            await self.silent.wait()
            quiet = time.monotonic() - max(self.last_serving, since or 0.0)
            if quiet > self.dead_after:
                return self.silent_for()
            await asyncio.sleep(self.dead_after - quiet)

    async def _poll(self) -> None:
        request = health_pb2.HealthCheckRequest()
        serving = health_pb2.HealthCheckResponse.SERVING
        while True:
            try:
                resp = await self._stub.Check(request, timeout=self.dead_after / 2)
                ok = resp.status == serving
            except grpc.aio.AioRpcError:
                ok = False
            if ok:
                self.last_serving = time.monotonic()
                self.silent.clear()
            elif self.silent_for() > self.dead_after:
                self.silent.set()
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        """Stop polling (the channel stays the caller's)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


@contextlib.asynccontextmanager
async def watch_address(address: str, dead_after: float):
    """A started ``HealthWatch`` on a channel of its own to ``address`` (an internal service: over
    this process's TLS, see ``tls.internal_channel``); both closed on exit."""
    async with tls.internal_channel(address, GRPC_OPTIONS) as channel:
        watch = HealthWatch(channel, dead_after)
        watch.start()
        try:
            yield watch
        finally:
            await watch.close()
