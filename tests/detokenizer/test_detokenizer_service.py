"""The Detokenizer gRPC service in-process: a real decode-scheduler-style client stream in, real
GatewayOutput and DecodeScheduler servicers of this test collecting what comes out."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import grpc
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from pdserve.rpc.client_stream import ClientStreamSender
from pdserve.rpc.server import GrpcServer, wait_for_health
from pdserve.services.detokenizer.main import build_parser, start_server
from pdserve.tokenization import Tokenizer
from pdserve.v1 import common_pb2, output_pb2, output_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

TEXT = "The quick brown fox jumps over the lazy dog. 你好世界 😀 and the end."
STOP = "lazy"


class GatewayCollector(output_pb2_grpc.GatewayOutputServicer):
    """A gateway's output endpoint that keeps every BatchStrOutput it receives."""

    def __init__(self) -> None:
        self.batches: list[output_pb2.BatchStrOutput] = []

    async def StreamStrOutputs(self, request_iterator, context) -> output_pb2.StreamAck:
        async for batch in request_iterator:
            self.batches.append(batch)
        return output_pb2.StreamAck()

    def outputs(self) -> dict[str, list[output_pb2.StrOutput]]:
        by_rid = defaultdict(list)
        for batch in self.batches:
            for out in batch.outputs:
                by_rid[out.rid].append(out)
        return by_rid


class AbortCollector(scheduler_pb2_grpc.DecodeSchedulerServicer):
    """A decode-scheduler that records the Abort calls it gets."""

    def __init__(self) -> None:
        self.aborts: list[tuple[str, str]] = []

    async def Abort(self, request, context) -> scheduler_pb2.AbortResponse:
        self.aborts.append((request.rid, request.reason))
        return scheduler_pb2.AbortResponse(found=True)


async def start_peer(servicer, register) -> GrpcServer:
    server = GrpcServer("127.0.0.1:0", [])
    server.add(register, servicer)
    await server.start()
    return server


@pytest_asyncio.fixture(scope="module")
async def detokenizer():
    server, servicer = await start_server(build_parser().parse_args(["--port", "0"]))
    assert await wait_for_health(server.address, timeout=10)
    yield server, servicer
    await server.stop(0)
    await servicer.close()


def first_output(
    rid: str, ids: list[int], gateway: str, scheduler: str, **kwargs
) -> output_pb2.TokenIDOutput:
    return output_pb2.TokenIDOutput(
        rid=rid,
        token_ids=ids,
        gateway_address=gateway,
        scheduler_address=scheduler,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        completion_tokens=len(ids),
        **kwargs,
    )


async def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_stream_text_stop_abort_and_routing(detokenizer, tokenizer: Tokenizer) -> None:
    server, servicer = detokenizer
    gateway_a, gateway_b, scheduler = GatewayCollector(), GatewayCollector(), AbortCollector()
    peers = [
        await start_peer(gateway_a, output_pb2_grpc.add_GatewayOutputServicer_to_server),
        await start_peer(gateway_b, output_pb2_grpc.add_GatewayOutputServicer_to_server),
        await start_peer(scheduler, scheduler_pb2_grpc.add_DecodeSchedulerServicer_to_server),
    ]
    addr_a, addr_b, addr_sched = (p.address for p in peers)
    sender = ClientStreamSender(server.address, lambda ch: output_pb2_grpc.DetokenizerStub(ch).StreamTokenIDs)

    ids = tokenizer.encode(TEXT, add_special_tokens=False) + [tokenizer.hf.eos_token_id]
    steps = len(ids)
    for step, token in enumerate(ids):
        batch = output_pb2.BatchTokenIDOutput()
        last = step == steps - 1
        if step == 0:
            batch.outputs.extend(
                [
                    first_output("plain", [token], addr_a, addr_sched, index=0),
                    first_output("stopped", [token], addr_b, addr_sched, stop=[STOP, "never"], index=2),
                    first_output("aborted", [token], addr_a, addr_sched, index=1),
                ]
            )
        else:
            finish = common_pb2.FINISH_REASON_STOP if last else common_pb2.FINISH_REASON_UNSPECIFIED
            batch.outputs.add(
                rid="plain", token_ids=[token], finish_reason=finish, matched_stop_token=token * last
            )
            batch.outputs.add(rid="stopped", token_ids=[token])  # keeps coming until the Abort lands
            if step == 1:
                abort = common_pb2.FINISH_REASON_ABORT
                batch.outputs.add(rid="aborted", token_ids=[token], finish_reason=abort, error="client gone")
        sender.send(batch)

    def finished(gateway: GatewayCollector, rid: str) -> bool:
        outs = gateway.outputs().get(rid, [])
        return bool(outs) and outs[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED

    await wait_until(lambda: finished(gateway_a, "plain") and finished(gateway_a, "aborted"))
    await wait_until(lambda: finished(gateway_b, "stopped") and scheduler.aborts)
    await sender.close()

    a, b = gateway_a.outputs(), gateway_b.outputs()
    assert set(a) == {"plain", "aborted"} and set(b) == {"stopped"}
    assert len(gateway_a.batches) == steps  # one BatchStrOutput per step and gateway

    plain = a["plain"]
    assert "".join(o.text_delta for o in plain) == tokenizer.hf.decode(ids, skip_special_tokens=True)
    assert [t for o in plain for t in o.token_ids] == ids
    assert (plain[-1].finish_reason, plain[-1].matched_stop_token) == (common_pb2.FINISH_REASON_STOP, ids[-1])
    assert {o.index for o in plain} == {0}

    aborted = a["aborted"]
    assert len(aborted) == 2 and aborted[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert aborted[-1].error == "client gone" and {o.index for o in aborted} == {1}
    assert "".join(o.text_delta for o in aborted) == tokenizer.hf.decode(ids[:2])

    stopped = b["stopped"]
    assert "".join(o.text_delta for o in stopped) == TEXT[: TEXT.index(STOP)]
    assert [o.finish_reason for o in stopped[:-1]] == [common_pb2.FINISH_REASON_UNSPECIFIED] * (
        len(stopped) - 1
    )
    assert (stopped[-1].finish_reason, stopped[-1].matched_stop) == (common_pb2.FINISH_REASON_STOP, STOP)
    assert {o.index for o in stopped} == {2}
    assert len(stopped) < steps  # ids after the stop were ignored
    assert scheduler.aborts == [("stopped", "stop")]

    async with grpc.aio.insecure_channel(server.address) as channel:
        metrics = await output_pb2_grpc.DetokenizerStub(channel).GetMetrics(common_pb2.MetricsRequest())
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics.text) for s in f.samples}
    assert metrics.role == "detokenizer" and metrics.worker == server.address
    assert samples["pdserve:detokenizer_active_streams"] == 0
    assert samples["pdserve:detokenizer_tokens_total"] == len(ids) + len(stopped) + 2
    assert samples["pdserve:detokenizer_stop_string_matches_total"] == 1
    for peer in peers:
        await peer.stop(0)


async def test_batch_breaking_the_contract_ends_the_stream_with_invalid_argument(detokenizer) -> None:
    server, servicer = detokenizer
    out = first_output("dup", [5], "127.0.0.1:1", "")

    async def batches():
        yield output_pb2.BatchTokenIDOutput(outputs=[out, out])

    async with grpc.aio.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await output_pb2_grpc.DetokenizerStub(channel).StreamTokenIDs(batches())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than once" in err.value.details()
    assert servicer.detokenizer.num_active == 0


async def test_column_rows_stay_columns_until_a_stop_string_ends_one(
    detokenizer, tokenizer: Tokenizer
) -> None:
    """Steady rows travel as columns both ways; a column row that completes a stop string comes out
    as a StrOutput with the STOP finish, and every step is one BatchStrOutput."""
    server, _ = detokenizer
    gateway, scheduler = GatewayCollector(), AbortCollector()
    peers = [
        await start_peer(gateway, output_pb2_grpc.add_GatewayOutputServicer_to_server),
        await start_peer(scheduler, scheduler_pb2_grpc.add_DecodeSchedulerServicer_to_server),
    ]
    address, sched_address = (p.address for p in peers)
    sender = ClientStreamSender(server.address, lambda ch: output_pb2_grpc.DetokenizerStub(ch).StreamTokenIDs)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    for step, token in enumerate(ids):
        if step == 0:
            batch = output_pb2.BatchTokenIDOutput(
                outputs=[
                    first_output("col", [token], address, sched_address),
                    first_output("col-stop", [token], address, sched_address, stop=[STOP]),
                ]
            )
        else:
            batch = output_pb2.BatchTokenIDOutput(
                rids=["col", "col-stop"], num_token_ids=[1, 1], token_ids=[token, token]
            )
            batch.completion_tokens.extend([step + 1, step + 1])
        sender.send(batch)
    await wait_until(lambda: len(gateway.batches) == len(ids) and scheduler.aborts)
    assert scheduler.aborts == [("col-stop", "stop")]
    await sender.close()
    # "col" never finished: the ended stream fails it (retryable) and tells its scheduler
    await wait_until(lambda: len(scheduler.aborts) == 2 and len(gateway.batches) == len(ids) + 1)
    assert scheduler.aborts == [("col-stop", "stop"), ("col", "its output stream ended")]
    lost = gateway.batches[-1].outputs
    assert [(o.rid, o.finish_reason, o.retryable) for o in lost] == [
        ("col", common_pb2.FINISH_REASON_ERROR, True)
    ]

    text = {"col": "", "col-stop": ""}
    for batch in gateway.batches:
        for out in batch.outputs:
            text[out.rid] += out.text_delta
        for rid, delta in zip(batch.rids, batch.text_deltas, strict=True):
            text[rid] += delta
    assert text["col"] == tokenizer.hf.decode(ids)
    assert text["col-stop"] == TEXT[: TEXT.index(STOP)]
    stopped = [o for b in gateway.batches for o in b.outputs if o.rid == "col-stop"]
    assert (stopped[-1].finish_reason, stopped[-1].matched_stop) == (common_pb2.FINISH_REASON_STOP, STOP)
    assert all(len(b.rids) == len(b.text_deltas) == len(b.completion_tokens) for b in gateway.batches)
    assert sum(len(b.rids) for b in gateway.batches) >= len(ids) - 1  # "col" after its first output
    for peer in peers:
        await peer.stop(0)
