"""HealthWatch over real gRPC: silent after ``dead_after`` without SERVING (NOT_SERVING, or no server
answering), and not any more once SERVING comes back."""

from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.rpc.health_watch import HealthWatch
from pdserve.rpc.server import GrpcServer

DEAD_AFTER = 1.0
BOUND = 1.5 * DEAD_AFTER + 0.25 + 1.0  # documented worst case, plus slack for a loaded machine


async def silent_within(watch: HealthWatch) -> float:
    t0 = time.monotonic()
    await asyncio.wait_for(watch.wait_silent(), 10)
    return time.monotonic() - t0


async def test_silent_on_not_serving_and_on_no_answer_then_back() -> None:
    server = GrpcServer("127.0.0.1:0", ["test.Service"])
    await server.start()
    await server.set_serving(True)
    channel = grpc.aio.insecure_channel(server.address)
    watch = HealthWatch(channel, DEAD_AFTER)
    try:
        watch.start()
        await asyncio.sleep(2 * DEAD_AFTER)
        assert not watch.silent.is_set() and watch.silent_for() < DEAD_AFTER

        await server.set_serving(False)
        took = await silent_within(watch)
        assert DEAD_AFTER - 0.3 <= took <= BOUND, took
        assert await asyncio.wait_for(watch.wait_silent(), 0.1) >= DEAD_AFTER  # at once while silent

        await server.set_serving(True)
        for _ in range(40):
            if not watch.silent.is_set():
                break
            await asyncio.sleep(0.1)
        assert not watch.silent.is_set()

        await server.stop(0)  # nothing answers any more
        took = await silent_within(watch)
        assert took <= BOUND, took
    finally:
        await watch.close()
        await channel.close()
        await server.stop(0)
