"""Who may end or reuse a request in flight, on a gateway with two API keys (one per client) over the
colocated stack's workers: only the key a request was sent with can abort it (any other key is told
``found=false``, as for a rid that does not exist), and rids are per key: a rid in flight is refused
to a second request of the same key (409 / ALREADY_EXISTS) while the first goes on, and is free for
another key."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from pdserve.v1 import api_pb2, api_pb2_grpc, common_pb2
from tests.gateway.conftest import replica_of
from tests.reference import hf_greedy, hf_tokenizer

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
MODEL = "SmolLM2-135M-Instruct"


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def long_request(rid: str, max_new_tokens: int = 400) -> api_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return api_pb2.GenerateRequest(rid=rid, text="Count to a thousand:", sampling_params=sampling)


def rid_headers(key: str, rid: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "X-Request-Id": rid}


async def rest(call) -> list[api_pb2.GenerateResponse]:
    """The pieces of a stream that is being ``read()`` until it ends."""
    pieces = []
    while (piece := await call.read()) is not grpc.aio.EOF:
        pieces.append(piece)
    return pieces


@pytest.fixture
async def gateway(colocated):
    async with replica_of(colocated, "--api-key", f"{KEY_A},{KEY_B}") as replica:
        yield replica


@pytest.fixture
async def stub(gateway):
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        yield api_pb2_grpc.PdServeStub(channel)


async def test_only_the_key_a_request_was_sent_with_can_abort_it(gateway, stub) -> None:
    call = stub.Generate(long_request("owned-grpc"), metadata=auth(KEY_A), timeout=120)
    pieces = [await call.read()]
    foreign = await stub.Abort(api_pb2.PublicAbortRequest(rid="owned-grpc"), metadata=auth(KEY_B))
    unknown = await stub.Abort(api_pb2.PublicAbortRequest(rid="no-such-rid"), metadata=auth(KEY_B))
    assert (foreign.found, unknown.found) == (False, False)
    while sum(len(p.token_ids) for p in pieces) < 8:  # it goes on
        pieces.append(await call.read())
    assert all(p.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for p in pieces)
    own = await stub.Abort(api_pb2.PublicAbortRequest(rid="owned-grpc"), metadata=auth(KEY_A))
    assert own.found
    pieces += await rest(call)
    assert pieces[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert sum(len(p.token_ids) for p in pieces) < 400

    # a request sent over HTTP is owned by its key the same way
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True}
    url = f"http://127.0.0.1:{gateway.http_port}"
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Request-Id": "owned-http"}
    async with (
        httpx.AsyncClient(base_url=url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as r,
    ):
        assert r.status_code == 200
        chunks = []
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 1:
                foreign = await stub.Abort(api_pb2.PublicAbortRequest(rid="owned-http"), metadata=auth(KEY_B))
                own = await stub.Abort(api_pb2.PublicAbortRequest(rid="owned-http"), metadata=auth(KEY_A))
                assert (foreign.found, own.found) == (False, True)
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"


async def test_a_rid_in_flight_is_refused_to_its_own_key_and_free_for_another(gateway, stub) -> None:
    """Rids are per API key: the same key gets 409 / ALREADY_EXISTS for a rid it has in flight, while
    another key's request of that rid is served (it learns nothing of the first, cannot block it,
    and its Abort ends only its own); the first goes on to its length."""
    first = stub.Generate(long_request("dup-1", max_new_tokens=32), metadata=auth(KEY_A), timeout=120)
    pieces = [await first.read()]
    message = "request id 'dup-1' is already in flight"
    url = f"http://127.0.0.1:{gateway.http_port}"
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        r = await http.post("/v1/completions", json=body, headers=rid_headers(KEY_A, "dup-1"))
        assert r.status_code == 409
        error = {"message": message, "type": "invalid_request_error", "param": "rid", "code": "duplicate_rid"}
        assert r.json() == {"error": error}
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(long_request("dup-1", 4), metadata=auth(KEY_A), timeout=120):
                pass
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.ALREADY_EXISTS, message)

        other = await http.post("/v1/completions", json=body, headers=rid_headers(KEY_B, "dup-1"))
        assert other.status_code == 200, other.text
        expected = hf_greedy(hf_tokenizer().encode(body["prompt"]), 4)
        assert other.json()["choices"][0]["text"] == hf_tokenizer().decode(expected)
        second = stub.Generate(long_request("dup-1", max_new_tokens=400), metadata=auth(KEY_B), timeout=120)
        await second.read()
        assert (await stub.Abort(api_pb2.PublicAbortRequest(rid="dup-1"), metadata=auth(KEY_B))).found
        assert (await rest(second))[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    pieces += await rest(first)
    assert sum(len(p.token_ids) for p in pieces) == 32
    assert pieces[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_one_rid_in_flight_on_two_replicas_is_two_requests(colocated, stub) -> None:
    """Replicas share the workers, and each tags the rids it sends (``backend_rid``): a client-chosen
    rid in flight on two replicas is two requests in the backends. Before, the decode scheduler
    refused the second and its replica's cleanup abort ended the first (on separate decode workers,
    a shared detokenizer would have routed one's tokens to the other's client). Each stream is
    HF's greedy continuation of its own prompt."""
    prompts = [hf_tokenizer().encode(text) for text in ("The capital of France is", "Rain falls when")]
    expected = [hf_greedy(ids, 24) for ids in prompts]

    def request(ids: list[int]) -> api_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(max_new_tokens=24, temperature=0.0)
        return api_pb2.GenerateRequest(rid="shared-rid", input_ids={"ids": ids}, sampling_params=sampling)

    async with grpc.aio.insecure_channel(colocated.grpc_address) as channel:
        first = api_pb2_grpc.PdServeStub(channel).Generate(request(prompts[0]), timeout=120)
        pieces = [[await first.read()], []]
        second = stub.Generate(request(prompts[1]), metadata=auth(KEY_B), timeout=120)
        pieces[1] = await rest(second)
        pieces[0] += await rest(first)
    for got, want in zip(pieces, expected, strict=True):
        assert [t for p in got for t in p.token_ids] == want
        assert got[-1].finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
