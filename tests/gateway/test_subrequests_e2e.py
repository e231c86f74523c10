"""A request's sub-requests (prompts × n) count against ``--max-pending-requests`` and all end with it.

A second gateway replica with a limit of 4 runs on the PD ``stack``'s workers (as in
``test_openai_e2e``): a batch that alone passes the limit is a 400 naming ``n`` and one that would
take the replica past it a 429, before anything is queued; a batch whose client disconnects, or
whose rid is aborted on the public gRPC API, has every sub-request aborted in the schedulers.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx

from pdserve.services.gateway.main import Gateway, parse_args
from pdserve.v1 import api_pb2, api_pb2_grpc, common_pb2
from tests.gateway.test_openai_e2e import wait_schedulers_idle

LIMIT = 4
SLOW = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}


async def replica_of(stack) -> Gateway:
    roles = httpx.get(f"{stack.base_url}/health", timeout=10).json()["roles"]
    flags = [f"--{role}-addresses={','.join(addrs)}" for role, addrs in roles.items()]
    args = parse_args(
        [*flags, "--port", "0", "--grpc-port", "0", "--max-pending-requests", str(LIMIT)]
        + ["--log-level", "warning"]
    )
    replica = Gateway(args)
    await replica.start()
    return replica


async def test_sub_requests_count_against_the_pending_limit(stack) -> None:
    replica = await replica_of(stack)
    url = f"http://127.0.0.1:{replica.http_port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            too_big = await http.post(
                "/generate", json={"text": ["a", "b", "c"], "sampling_params": {"n": 2}}
            )
            assert too_big.status_code == 400, too_big.text
            assert too_big.json()["error"]["param"] == "sampling_params.n"
            assert "6 sub-requests" in too_big.json()["error"]["message"]
            batch = {"text": ["Count:", "List:"], "stream": True, "sampling_params": {**SLOW, "n": 2}}
            async with http.stream("POST", "/generate", json=batch) as stream:
                assert stream.status_code == 200
                lines = stream.aiter_lines()
                assert (await anext(lines)).startswith("data: {")
                assert replica.manager.pending_choices == LIMIT
                one_more = await http.post("/generate", json={"text": "x", "sampling_params": SLOW})
                assert one_more.status_code == 429 and one_more.headers["retry-after"] == "1"
                assert one_more.json()["error"]["type"] == "rate_limit_error"
            # the client went away: all 4 sub-requests end in every scheduler
            await wait_schedulers_idle(stack, within=3.0)
            assert replica.manager.pending_choices == 0
            ok = await http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
            assert ok.status_code == 200, ok.text
    finally:
        await replica.stop()


async def test_a_disconnected_batch_is_aborted_everywhere(stack) -> None:
    replica = await replica_of(stack)
    url = f"http://127.0.0.1:{replica.http_port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            batch = {"text": ["Count:", "List:"], "sampling_params": {**SLOW, "n": 2}}
            call = asyncio.create_task(http.post("/generate", json=batch))
            await asyncio.sleep(0.5)
            call.cancel()  # closes the connection before any answer: the gateway sees a disconnect
        await wait_schedulers_idle(stack, within=3.0)
        assert replica.manager.pending_choices == 0 and not replica.manager.handles
    finally:
        await replica.stop()


async def test_public_abort_ends_every_sample(stack) -> None:
    request = api_pb2.GenerateRequest(
        rid="abort-all-samples",
        text="Count to a thousand:",
        sampling_params=common_pb2.SamplingParams(n=3, max_new_tokens=400, ignore_eos=True),
    )
    async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
        stub = api_pb2_grpc.PdServeStub(channel)
        aborted = False
        ends = {}
        async for piece in stub.Generate(request, timeout=120):
            if not aborted and piece.token_ids:
                aborted = (await stub.Abort(api_pb2.PublicAbortRequest(rid=request.rid))).found
                assert aborted
            if piece.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                ends[piece.index] = piece.finish_reason
    assert ends == dict.fromkeys(range(3), common_pb2.FINISH_REASON_ABORT)
    await wait_schedulers_idle(stack, within=3.0)
