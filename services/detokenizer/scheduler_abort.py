"""Fire-and-forget DecodeScheduler.Abort calls for requests a stop string ended."""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.rpc import tls
from pdserve.rpc.server import GRPC_OPTIONS
from pdserve.services.detokenizer.convert import abort_request, decode_scheduler_stub

logger = logging.getLogger(__name__)


class SchedulerAborter:
    """Sends ``Abort(rid, reason)`` to decode-schedulers without blocking the caller.

    One channel per scheduler address, reused. A failed call is logged: the scheduler then ends
    the request by its own limits, and the detokenizer ignores its further ids anyway.
    """

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def abort(self, address: str, rid: str, reason: str, stopped: bool = False) -> None:
        """Abort ``rid`` at the decode-scheduler at ``address``; it counts as aborted, or as stopped
        (finish reason STOP) when ``stopped`` (a matched stop string)."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = tls.internal_channel(address, GRPC_OPTIONS)
        task = asyncio.get_running_loop().create_task(self._call(channel, address, rid, reason, stopped))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(
        self, channel: grpc.aio.Channel, address: str, rid: str, reason: str, stopped: bool
    ) -> None:
        request = abort_request(rid, reason, stopped)
        try:
            await decode_scheduler_stub(channel).Abort(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            logger.warning(
                "Abort(%s) on %s failed: %s %s", rid, address, e.code(), e.details(), extra={"rid": rid}
            )

    async def close(self) -> None:
        """Wait for calls in flight (up to their timeout), then close the channels."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
