"""The public gRPC API (PdServe) and the internal GatewayOutput service, without schedulers.

Real grpc.aio clients against the gateway of ``local_gateway``: API key, status codes, ListModels,
and requests refused with the same message as their HTTP equivalents.
"""

from __future__ import annotations

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoConfig

from pdserve.model_source import resolve_model
from pdserve.v1 import api_pb2, api_pb2_grpc, common_pb2, output_pb2, output_pb2_grpc, tokenizer_pb2
from tests.gateway.conftest import API_KEY
from tests.reference import chat_ids

AUTH = (("authorization", f"Bearer {API_KEY}"),)
SP = common_pb2.SamplingParams
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
async def channel(local_gateway):
    async with grpc.aio.insecure_channel(local_gateway.grpc_address) as ch:
        yield ch


async def generate_error(channel, request: api_pb2.GenerateRequest, metadata=AUTH) -> grpc.aio.AioRpcError:
    stub = api_pb2_grpc.PdServeStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stub.Generate(request, metadata=metadata, timeout=30):
            pass
    return e.value


async def test_list_models_needs_the_key(channel) -> None:
    stub = api_pb2_grpc.PdServeStub(channel)
    resp = await stub.ListModels(api_pb2.ListModelsRequest(), metadata=AUTH)
    context = AutoConfig.from_pretrained(resolve_model()).max_position_embeddings
    assert [(m.id, m.context_length) for m in resp.models] == [(MODEL, context)]
    for metadata in [(), (("authorization", "Bearer nope"),)]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ListModels(api_pb2.ListModelsRequest(), metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    err = await generate_error(channel, api_pb2.GenerateRequest(text="hi"), metadata=())
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("request_", "code", "needle"),
    [
        (api_pb2.GenerateRequest(model="gpt-17", text="hi"), grpc.StatusCode.NOT_FOUND, "gpt-17"),
        (api_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "text, input_ids or chat"),
        (api_pb2.GenerateRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT, "text"),
        (
            api_pb2.GenerateRequest(text="hi", sampling_params=SP(temperature=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "temperature",
        ),
        (
            api_pb2.GenerateRequest(text="hi", sampling_params=SP(top_p=2)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p",
        ),
        (
            api_pb2.GenerateRequest(text="hi", sampling_params=SP(top_logprobs_num=50)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_logprobs_num",
        ),
    ],
    ids=["unknown-model", "no-input", "empty-text", "temperature", "top-p", "top-logprobs"],
)
async def test_generate_invalid(channel, request_, code, needle) -> None:
    err = await generate_error(channel, request_)
    assert err.code() == code
    assert needle in err.details()


HI = [{"role": "user", "content": "hi"}]


def chat_request(messages=HI, sampling_params=None, **chat_fields) -> api_pb2.GenerateRequest:
    chat = tokenizer_pb2.ChatMessages(
        messages=[tokenizer_pb2.ChatMessage(**m) for m in messages], add_generation_prompt=True, **chat_fields
    )
    return api_pb2.GenerateRequest(chat=chat, sampling_params=sampling_params)


# (gRPC request, the HTTP path and body that mean the same, the field its error names)
SAME_AS_HTTP = {
    "unknown-role": (
        chat_request([{"role": "x", "content": "hi"}]),
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "x", "content": "hi"}]},
        "messages.0.role",
    ),
    "tool-message": (
        chat_request([{"role": "tool", "content": "1"}]),
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "tool", "content": "1"}]},
        "tool_calls",
    ),
    "no-messages": (
        chat_request([]),
        "/v1/chat/completions",
        {"model": MODEL, "messages": []},
        "messages",
    ),
    "continue-final-message": (
        chat_request(continue_final_message=True),
        "/v1/chat/completions",
        {"model": MODEL, "messages": HI, "continue_final_message": True},
        "continue_final_message",
    ),
    "n-zero": (
        chat_request(sampling_params=SP(n=0)),
        "/generate",
        {"text": "hi", "sampling_params": {"n": 0}},
        "sampling_params.n",
    ),
    "top-logprobs-without-logprob": (
        api_pb2.GenerateRequest(text="hi", sampling_params=SP(top_logprobs_num=2)),
        "/generate",
        {"text": "hi", "top_logprobs_num": 2},
        "'top_logprobs_num' requires 'return_logprob'",
    ),
}


@pytest.mark.parametrize(("request_", "path", "body", "field"), SAME_AS_HTTP.values(), ids=SAME_AS_HTTP)
async def test_generate_refuses_what_http_refuses_with_its_message(
    local_gateway, channel, request_, path, body, field
) -> None:
    async with httpx.AsyncClient(base_url=local_gateway.base_url, timeout=30) as client:
        r = await client.post(path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    err = await generate_error(channel, request_)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == r.json()["error"]["message"]
    assert field in err.details()


async def test_generate_refuses_tools_json_that_is_not_json(channel) -> None:
    err = await generate_error(channel, chat_request(tools_json="[{"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'tools_json' is not valid JSON" in err.details()


async def test_generate_too_long_for_context_names_both_numbers(channel) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    context = AutoConfig.from_pretrained(resolve_model()).max_position_embeddings
    chat = tokenizer_pb2.ChatMessages(
        messages=[tokenizer_pb2.ChatMessage(**m) for m in messages], add_generation_prompt=True
    )
    request = api_pb2.GenerateRequest(chat=chat, sampling_params=SP(max_new_tokens=context))
    err = await generate_error(channel, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    prompt = len(chat_ids(messages))
    assert str(context) in err.details() and str(prompt + context) in err.details()


async def test_generate_without_decode_workers_is_unavailable(channel) -> None:
    err = await generate_error(channel, api_pb2.GenerateRequest(input_ids=api_pb2.TokenIds(ids=[1, 2, 3])))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


async def test_abort_of_unknown_rid_is_not_found(channel) -> None:
    resp = await api_pb2_grpc.PdServeStub(channel).Abort(
        api_pb2.PublicAbortRequest(rid="nope"), metadata=AUTH
    )
    assert resp.found is False


async def test_internal_services_need_no_key(channel) -> None:
    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING

    async def outputs():
        yield output_pb2.BatchStrOutput(outputs=[output_pb2.StrOutput(rid="not-mine", text_delta="x")])

    ack = await output_pb2_grpc.GatewayOutputStub(channel).StreamStrOutputs(outputs())
    assert isinstance(ack, output_pb2.StreamAck)
