"""ClientStreamSender / ClientStreamPool against a real grpc.aio server that stops, restarts or never
comes up: dead targets are reported once with the messages that never left, live ones get everything."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.rpc.client_stream import ClientStreamPool, ClientStreamSender
from pdserve.rpc.server import GrpcServer
from pdserve.v1 import output_pb2, output_pb2_grpc
from tests.stack import free_port_block

DEAD_AFTER = 1.0
SLACK = 1.5  # event-loop and scheduling noise on a loaded 2-core machine


class Receiver(output_pb2_grpc.DetokenizerServicer):
    """A detokenizer endpoint that keeps the rid of every output it receives, in order."""

    def __init__(self) -> None:
        self.rids: list[str] = []

    async def StreamTokenIDs(self, request_iterator, context) -> output_pb2.StreamAck:
        async for batch in request_iterator:
            self.rids.extend(out.rid for out in batch.outputs)
        return output_pb2.StreamAck()


class DeadLog:
    """Records every ``on_dead(target, dropped)`` call with the loop time it came at."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, str, list[str]]] = []

    def __call__(self, target: str, dropped: list[output_pb2.BatchTokenIDOutput]) -> None:
        rids = [out.rid for batch in dropped for out in batch.outputs]
        self.calls.append((asyncio.get_running_loop().time(), target, rids))


def batch(rid: str) -> output_pb2.BatchTokenIDOutput:
    return output_pb2.BatchTokenIDOutput(outputs=[output_pb2.TokenIDOutput(rid=rid, token_ids=[1])])


def open_call(channel):
    return output_pb2_grpc.DetokenizerStub(channel).StreamTokenIDs


async def start_receiver(port: int = 0) -> tuple[GrpcServer, Receiver]:
    receiver = Receiver()
    server = GrpcServer(f"127.0.0.1:{port}", [])
    server.add(output_pb2_grpc.add_DetokenizerServicer_to_server, receiver)
    await server.start()
    return server, receiver


async def wait_until(condition, timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def stop_and_wait_for_failure(server: GrpcServer) -> float:
    """Stop ``server`` at once; returns the loop time it stopped at, after the open call has failed.

    The client's call fails as the server cancels it; sending only after that keeps the next messages
    in the sender's queue (a message handed to the failing call would be lost, as documented).
    """
    await server.stop(0)
    stopped = asyncio.get_running_loop().time()
    await asyncio.sleep(0.3)
    return stopped


async def test_stopped_target_is_reported_dead_with_the_queued_messages() -> None:
    server, receiver = await start_receiver()
    dead = DeadLog()
    sender = ClientStreamSender(server.address, open_call, dead_after=DEAD_AFTER, on_dead=dead)
    try:
        sender.send(batch("delivered"))
        await wait_until(lambda: receiver.rids == ["delivered"], timeout=5)
        stopped = await stop_and_wait_for_failure(server)
        for rid in ("queued-1", "queued-2"):
            sender.send(batch(rid))
        await wait_until(lambda: dead.calls, timeout=DEAD_AFTER + SLACK + 1)
        (when, target, dropped), *more = dead.calls
        assert not more and target == server.address
        assert dropped == ["queued-1", "queued-2"]
        assert DEAD_AFTER <= when - stopped <= DEAD_AFTER + SLACK, when - stopped
        with pytest.raises(RuntimeError):
            sender.send(batch("after-death"))
        await asyncio.sleep(DEAD_AFTER)
        assert len(dead.calls) == 1  # reported once
    finally:
        await sender.close()


async def test_target_restarted_within_dead_after_gets_the_queued_messages() -> None:
    server, first = await start_receiver()
    port = server.port
    dead = DeadLog()
    dead_after = 3.0  # room for the restart; the channel probes at least once a second
    sender = ClientStreamSender(server.address, open_call, dead_after=dead_after, on_dead=dead)
    try:
        sender.send(batch("before"))
        await wait_until(lambda: first.rids == ["before"], timeout=5)
        stopped = await stop_and_wait_for_failure(server)
        for rid in ("while-down-1", "while-down-2"):
            sender.send(batch(rid))
        server, second = await start_receiver(port)
        await wait_until(lambda: second.rids == ["while-down-1", "while-down-2"], timeout=dead_after)
        # past the point where a still-unreachable target would have been declared dead
        await asyncio.sleep(max(0.0, stopped + dead_after + SLACK - asyncio.get_running_loop().time()))
        sender.send(batch("later"))
        await wait_until(lambda: second.rids[-1:] == ["later"], timeout=5)
        assert dead.calls == []
        assert first.rids == ["before"]
    finally:
        await sender.close()
        await server.stop(0)


async def test_pool_forgets_a_dead_target_and_serves_it_again_once_it_is_back() -> None:
    dead = DeadLog()
    pool = ClientStreamPool(open_call, dead_after=DEAD_AFTER, on_dead=dead)
    port = free_port_block(1)
    address = f"127.0.0.1:{port}"
    try:
        # never came up: everything sent is reported back
        pool.send(address, batch("never-1"))
        pool.send(address, batch("never-2"))
        await wait_until(lambda: dead.calls, timeout=DEAD_AFTER + SLACK)
        assert [(t, d) for _, t, d in dead.calls] == [(address, ["never-1", "never-2"])]
        # the replica comes up on that address: the next send opens a fresh stream to it
        server, receiver = await start_receiver(port)
        try:
            pool.send(address, batch("fresh"))
            await wait_until(lambda: receiver.rids == ["fresh"], timeout=5)
            assert len(dead.calls) == 1
        finally:
            await server.stop(0)
    finally:
        await pool.close()
