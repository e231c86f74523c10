"""A decode-scheduler whose detokenizer dies aborts the requests that stream there, and only those.

In process, over real gRPC: the real ``DecodeServicer`` (colocated ``mixed`` role, the real model on
CPU) behind a grpc.aio server, fed by ``Generate`` calls, streaming to two detokenizer endpoints of
this test. One of them is stopped while its requests generate: they must end (pages freed once, the
pool conserved) within ``dead_after`` plus a step or two, while the other one's request runs to its
length. A detokenizer that comes back on the same port serves new requests again.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import grpc
import pytest
import pytest_asyncio
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.model_source import resolve_model
from pdserve.rpc.server import GrpcServer
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.scheduler import Scheduler, SchedulerConfig
from pdserve.services.common.convert import sampling_params_to_pb
from pdserve.services.decode.servicer import DecodeServicer
from pdserve.services.detokenizer.convert import column_rows
from pdserve.v1 import common_pb2, output_pb2, output_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.reference import chat_ids

DEAD_AFTER = 1.0
LONG = 400  # tokens a doomed request would generate if nothing stopped it
SHORT = 24
PROMPT = chat_ids([{"role": "user", "content": "Tell me a long story about the sea."}])


class Detokenizer(output_pb2_grpc.DetokenizerServicer):
    """A detokenizer endpoint that keeps every TokenIDOutput it receives, by rid (a column row kept
    as a TokenIDOutput of its rid, ids and completion tokens)."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[output_pb2.TokenIDOutput]] = defaultdict(list)

    async def StreamTokenIDs(self, request_iterator, context) -> output_pb2.StreamAck:
        async for batch in request_iterator:
            for out in batch.outputs:
                self.outputs[out.rid].append(out)
            for rid, ids, completion in column_rows(batch):
                self.outputs[rid].append(
                    output_pb2.TokenIDOutput(rid=rid, token_ids=ids, completion_tokens=completion)
                )
        return output_pb2.StreamAck()

    def tokens(self, rid: str) -> int:
        return sum(len(out.token_ids) for out in self.outputs[rid])

    def finish(self, rid: str) -> int:
        return self.outputs[rid][-1].finish_reason if self.outputs[rid] else 0


async def serve(register, servicer, port: int = 0) -> GrpcServer:
    server = GrpcServer(f"127.0.0.1:{port}", [])
    server.add(register, servicer)
    await server.start()
    return server


async def start_detokenizer(port: int = 0) -> tuple[GrpcServer, Detokenizer]:
    detokenizer = Detokenizer()
    return await serve(output_pb2_grpc.add_DetokenizerServicer_to_server, detokenizer, port), detokenizer


async def wait_until(condition, timeout: float) -> float:
    """Poll ``condition`` every 20 ms; returns the seconds it took. AssertionError after ``timeout``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not condition():
        assert loop.time() - start < timeout, "timed out"
        await asyncio.sleep(0.02)
    return loop.time() - start


@pytest.fixture(scope="module")
def scheduler() -> Scheduler:
    torch.set_num_threads(2)
    runner = ModelRunner(resolve_model(), dtype="float32", page_size=16, max_total_tokens=4096)
    return Scheduler(runner, SchedulerConfig(role="mixed"))


@pytest_asyncio.fixture(loop_scope="session")
async def decode(scheduler: Scheduler):
    """The DecodeServicer (its scheduler loop running) behind a real gRPC server; yields its stub."""
    server = GrpcServer("127.0.0.1:0", [])
    servicer = DecodeServicer(scheduler, server.address, agent=None, detokenizer_dead_after=DEAD_AFTER)
    server.add(scheduler_pb2_grpc.add_DecodeSchedulerServicer_to_server, servicer)
    await server.start()
    stop = asyncio.Event()
    loop_task = asyncio.create_task(servicer.loop.run(stop))
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield scheduler_pb2_grpc.DecodeSchedulerStub(channel)
    finally:
        await channel.close()
        await server.stop(0)
        stop.set()
        await loop_task
        await servicer.close()


async def generate(stub, rid: str, output_address: str, max_new_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    await stub.Generate(
        scheduler_pb2.TokenizedGenerateReqInput(
            rid=rid,
            input_ids=PROMPT,
            sampling_params=sampling_params_to_pb(params),
            output_address=output_address,
            gateway_address="127.0.0.1:1",
        )
    )


async def test_requests_of_a_dead_detokenizer_are_aborted(scheduler: Scheduler, decode) -> None:
    doomed_server, doomed = await start_detokenizer()
    live_server, live = await start_detokenizer()
    port = doomed_server.port
    try:
        doomed_rids = [f"doomed-{i}" for i in range(3)]
        for rid in doomed_rids:
            await generate(decode, rid, doomed_server.address, LONG)
        await generate(decode, "survivor", live_server.address, SHORT)
        await wait_until(lambda: all(doomed.tokens(rid) >= 2 for rid in doomed_rids), timeout=60)
        await doomed_server.stop(0)
        took = await wait_until(lambda: not any(rid in scheduler.reqs for rid in doomed_rids), timeout=10)
        assert took <= DEAD_AFTER + 3.0, took
        # aborted, not finished: far fewer tokens than asked for reached the dead detokenizer
        assert all(doomed.tokens(rid) < LONG for rid in doomed_rids)
        assert not any(doomed.finish(rid) for rid in doomed_rids)

        await wait_until(lambda: live.finish("survivor"), timeout=60)
        assert live.finish("survivor") == common_pb2.FINISH_REASON_LENGTH
        assert live.tokens("survivor") == SHORT
        assert not scheduler.reqs and scheduler.ledger.used_pages() == 0
        scheduler.check_invariants()

        # the detokenizer comes back on its address: a new request streams to it again
        doomed_server, back = await start_detokenizer(port)
        await generate(decode, "after-restart", doomed_server.address, SHORT)
        await wait_until(lambda: back.finish("after-restart"), timeout=60)
        assert back.tokens("after-restart") == SHORT
        assert back.outputs["after-restart"][0].gateway_address  # a first output: a fresh stream
    finally:
        await doomed_server.stop(0)
        await live_server.stop(0)
