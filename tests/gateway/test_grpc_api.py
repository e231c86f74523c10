"""The public gRPC API (PdServe) and the internal GatewayOutput service, without schedulers.

Real grpc.aio clients against the gateway of ``local_gateway``: API key, status codes, ListModels,
requests refused with the same message as their HTTP equivalents, and the two planes apart (the
public port serves no internal service; the internal port serves no public one).
"""

from __future__ import annotations

import logging

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from transformers import AutoConfig

from pdserve.model_source import resolve_model
from pdserve.v1 import (
    api_pb2,
    api_pb2_grpc,
    common_pb2,
    output_pb2,
    output_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
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
    "tool-call-id-off-a-tool-message": (
        chat_request([{"role": "user", "content": "1", "tool_call_id": "call_1"}]),
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "1", "tool_call_id": "call_1"}]},
        "tool_call_id",
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


@pytest.mark.parametrize(
    ("field", "text", "message"),
    [
        ("tools_json", "[{", "'tools_json' is not valid JSON"),
        ("tools_json", "[" * 100_000 + "]" * 100_000, "'tools_json' is not valid JSON"),  # too deep to parse
        (
            "chat_template_kwargs_json",
            '{"x": ' + "[" * 500 + "]" * 500 + "}",
            "nests 501 levels deep; at most 64",
        ),
    ],
    ids=["not-json", "too-deep-to-parse", "template-kwargs-too-deep"],
)
async def test_generate_refuses_json_fields_that_are_not_json_or_nest_too_deep(
    channel, field, text, message
) -> None:
    err = await generate_error(channel, chat_request(**{field: text}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.details()


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


# (method, how it is called, its request message)
UNARY_REQUEST_METHODS = [
    ("/pdserve.v1.PdServe/Generate", "unary_stream", "pdserve.v1.GenerateRequest"),
    ("/pdserve.v1.PdServe/Abort", "unary_unary", "pdserve.v1.PublicAbortRequest"),
    ("/pdserve.v1.PdServe/ListModels", "unary_unary", "pdserve.v1.ListModelsRequest"),
    ("/pdserve.v1.PdServe/LoadLoraAdapter", "unary_unary", "pdserve.v1.PublicLoadLoraAdapterRequest"),
    ("/pdserve.v1.PdServe/UnloadLoraAdapter", "unary_unary", "pdserve.v1.PublicUnloadLoraAdapterRequest"),
    ("/grpc.health.v1.Health/Check", "unary_unary", "grpc.health.v1.HealthCheckRequest"),
    ("/grpc.health.v1.Health/Watch", "unary_stream", "grpc.health.v1.HealthCheckRequest"),
]


async def call_with_bytes(
    channel, method: str, kind: str, data: bytes, metadata=AUTH
) -> grpc.aio.AioRpcError:
    """The error of calling ``method`` with ``data`` as its serialized request."""
    call = getattr(channel, kind)(method, request_serializer=lambda _: data, response_deserializer=bytes)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        if kind == "unary_stream":
            async for _ in call(None, metadata=metadata, timeout=30):
                pass
        else:
            await call(None, metadata=metadata, timeout=30)
    return e.value


async def test_lora_adapter_calls_need_the_key_and_bounded_fields(channel) -> None:
    """The operator calls are refused without the key, and a name out of bounds is INVALID_ARGUMENT
    (as /v1/load_lora_adapter's 400) before any worker is asked."""
    stub = api_pb2_grpc.PdServeStub(channel)
    load = api_pb2.PublicLoadLoraAdapterRequest(lora_name="a", lora_path="/tmp")
    unload = api_pb2.PublicUnloadLoraAdapterRequest(lora_name="a")
    for call, metadata, code in [
        (lambda m: stub.LoadLoraAdapter(load, metadata=m), (), grpc.StatusCode.UNAUTHENTICATED),
        (lambda m: stub.UnloadLoraAdapter(unload, metadata=m), (), grpc.StatusCode.UNAUTHENTICATED),
        (
            lambda m: stub.LoadLoraAdapter(api_pb2.PublicLoadLoraAdapterRequest(lora_name="a"), metadata=m),
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            lambda m: stub.UnloadLoraAdapter(api_pb2.PublicUnloadLoraAdapterRequest(), metadata=m),
            AUTH,
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(metadata)
        assert e.value.code() == code, e.value


@pytest.mark.parametrize(
    ("method", "kind", "message"), UNARY_REQUEST_METHODS, ids=lambda v: v.rsplit("/")[-1]
)
async def test_request_bytes_that_do_not_parse_are_invalid_argument(
    channel, caplog, method, kind, message
) -> None:
    """A request that is not its protobuf message is the client's error, named as such, and logs no
    traceback (grpcio alone answers UNKNOWN and logs one per call)."""
    with caplog.at_level(logging.WARNING):
        err = await call_with_bytes(channel, method, kind, b"\xff\xff\xff")
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    protobufs_reason = f"Error parsing message with type '{message}': Wire format was corrupt"
    assert err.details() == f"request is not a valid {message}: {protobufs_reason}"


async def test_request_bytes_that_do_not_parse_without_the_key_are_unauthenticated(channel) -> None:
    err = await call_with_bytes(channel, "/pdserve.v1.PdServe/Generate", "unary_stream", b"\xff", metadata=())
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


INTERNAL_CALLS = {
    "GatewayOutput.StreamStrOutputs": lambda ch: output_pb2_grpc.GatewayOutputStub(ch).StreamStrOutputs(
        iter([output_pb2.BatchStrOutput(outputs=[output_pb2.StrOutput(rid="not-mine", text_delta="x")])])
    ),
    "Detokenizer.StreamTokenIDs": lambda ch: output_pb2_grpc.DetokenizerStub(ch).StreamTokenIDs(
        iter([output_pb2.BatchTokenIDOutput()])
    ),
    "Tokenizer.Tokenize": lambda ch: tokenizer_pb2_grpc.TokenizerStub(ch).Tokenize(
        tokenizer_pb2.TokenizeRequest(text="hi")
    ),
    "DecodeScheduler.Generate": lambda ch: scheduler_pb2_grpc.DecodeSchedulerStub(ch).Generate(
        scheduler_pb2.TokenizedGenerateReqInput(rid="x", input_ids=[1])
    ),
    "DecodeScheduler.Abort": lambda ch: scheduler_pb2_grpc.DecodeSchedulerStub(ch).Abort(
        scheduler_pb2.AbortRequest(rid="x")
    ),
    "DecodeScheduler.FlushCache": lambda ch: scheduler_pb2_grpc.DecodeSchedulerStub(ch).FlushCache(
        scheduler_pb2.FlushCacheRequest()
    ),
    "PrefillScheduler.ExchangeKVAgentInfo": lambda ch: scheduler_pb2_grpc.PrefillSchedulerStub(
        ch
    ).ExchangeKVAgentInfo(scheduler_pb2.KVAgentInfo()),
}


@pytest.mark.parametrize("call", sorted(INTERNAL_CALLS))
@pytest.mark.parametrize("metadata", [(), AUTH], ids=["no-key", "key"])
async def test_public_port_refuses_internal_services(channel, call, metadata) -> None:
    """No internal service answers on the public port, with or without the API key: a client cannot
    write text into another client's stream (GatewayOutput) nor reach a scheduler through it."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await INTERNAL_CALLS[call](channel)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, e.value


async def test_public_port_lists_only_the_public_api(channel, local_gateway) -> None:
    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    [reply] = [r async for r in stub.ServerReflectionInfo(iter([request]))]
    services = {s.name for s in reply.list_services_response.service}
    assert services == {"pdserve.v1.PdServe", "grpc.health.v1.Health", reflection.SERVICE_NAME}
    models = await api_pb2_grpc.PdServeStub(channel).ListModels(api_pb2.ListModelsRequest(), metadata=AUTH)
    assert [m.id for m in models.models] == [MODEL]


async def test_internal_port_serves_gateway_output_only(local_gateway) -> None:
    """The detokenizers' GatewayOutput stream is on the internal address (no API key there: the plane is
    private, and mutual TLS when configured); the public API is not."""
    address = local_gateway.gateway.internal_address
    assert address.startswith("127.0.0.1:") and address != local_gateway.grpc_address
    async with grpc.aio.insecure_channel(address) as internal:
        ack = await INTERNAL_CALLS["GatewayOutput.StreamStrOutputs"](internal)
        assert isinstance(ack, output_pb2.StreamAck)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await api_pb2_grpc.PdServeStub(internal).ListModels(api_pb2.ListModelsRequest(), metadata=AUTH)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
