"""HealthWatch over real gRPC: silent after ``dead_after`` without SERVING (NOT_SERVING, or no server
answering), and not any more once SERVING comes back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.rpc.health_watch import HealthWatch
from pdserve.rpc.server import GrpcServer

DEAD_AFTER = 1.0
BOUND = 1.5 * DEAD_AFTER + 0.25 + 1.0  # documented worst case, plus slack for a loaded machine


async def silent_within(watch: HealthWatch) -> float:
    t0 = time.monotonic()
    await asyncio.wait_for(watch.wait_silent(), 10)
    return time.monotonic() - t0


@contextlib.asynccontextmanager
async def watched_server(serving: bool) -> AsyncIterator[tuple[GrpcServer, HealthWatch]]:
    """A gRPC server (``serving`` or not) and a HealthWatch on a channel to it; all closed after."""
    server = GrpcServer("127.0.0.1:0", ["test.Service"])
    await server.start()
    await server.set_serving(serving)
    channel = grpc.aio.insecure_channel(server.address)
    watch = HealthWatch(channel, DEAD_AFTER)
    try:
        yield server, watch
    finally:
        await watch.close()
        await channel.close()
        await server.stop(0)


async def test_silent_on_not_serving_and_on_no_answer_then_back() -> None:
    async with watched_server(serving=True) as (server, watch):
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


async def test_a_call_made_after_the_silence_gets_its_own_dead_after() -> None:
    """A process silent for a while (a restart) that answers SERVING again soon after a call begins:
    the call's watch (``since`` = its start) is not given up, though the process was silent before."""
    async with watched_server(serving=False) as (server, watch):
        await silent_within(watch)
        assert await asyncio.wait_for(watch.wait_silent(), 0.1) >= DEAD_AFTER  # silent before the call
        call_watch = asyncio.ensure_future(watch.wait_silent(since=time.monotonic()))
        await asyncio.sleep(DEAD_AFTER / 2)
        await server.set_serving(True)  # back within the call's own dead_after
        await asyncio.sleep(2 * DEAD_AFTER)
        assert not call_watch.done() and not watch.silent.is_set()
        await server.set_serving(False)  # silent again, for the call's whole dead_after: given up
        assert await asyncio.wait_for(call_watch, 10) > DEAD_AFTER
