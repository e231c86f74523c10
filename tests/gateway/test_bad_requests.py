"""Bad requests against a real gateway (uvicorn) + real tokenizer: status, OpenAI error shape, named field.

Expected context numbers come from the checkpoint's config.json and the HF tokenizer's chat template,
not from the gateway.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoConfig

from pdserve.model_source import resolve_model
from pdserve.sampling.bounds import MAX_CHOICES, MAX_GRAMMAR_CHARS, MAX_TOOLS, MAX_TOOLS_CHARS
from pdserve.services.gateway.errors import GatewayError, validate_as_body
from pdserve.services.gateway.openai.native_protocol import NativeGenerateRequest
from pdserve.services.gateway.openai.protocol import ChatCompletionRequest
from tests.gateway.conftest import API_KEY, MAX_REQUEST_BYTES
from tests.reference import chat_ids, hf_tokenizer

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HELLO = [{"role": "user", "content": "Hello there"}]


@functools.cache
def context_length() -> int:
    return AutoConfig.from_pretrained(resolve_model()).max_position_embeddings


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HELLO, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", **fields}


@dataclass
class Case:
    id: str
    status: int
    body: dict | list | bytes | Callable[[], dict] | None = None
    path: str = "/v1/chat/completions"
    method: str = "POST"
    headers: dict = field(default_factory=lambda: dict(AUTH))
    param: str | None = None
    code: str | None = None
    contains: Callable[[], list[str]] = lambda: []


def _too_long_for_context() -> dict:
    return chat(max_tokens=context_length())


def _context_numbers() -> list[str]:
    p, c = len(chat_ids(HELLO)), context_length()
    return [str(c), str(p + c), f"{p} in the prompt"]


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _nested(inner: dict | list, levels: int) -> dict | list:
    """``inner`` inside ``levels`` objects (``{"type": "object", "properties": {"a": ...}}``: two
    JSON levels each) or, for a list, ``levels`` lists."""
    for _ in range(levels):
        inner = [inner] if isinstance(inner, list) else {"type": "object", "properties": {"a": inner}}
    return inner


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


CASES = [
    Case("malformed-json", 400, b'{"model": "x", "messages": [', contains=lambda: ["JSON"]),
    Case("body-not-object", 400, [1, 2, 3]),
    Case("empty-body", 400, b""),
    Case("messages-wrong-type", 400, chat(messages="hi"), param="messages"),
    Case("messages-missing", 400, {"model": MODEL}, param="messages", contains=lambda: ["required"]),
    Case("messages-empty", 400, chat(messages=[]), param="messages"),
    Case("role-unknown", 400, chat(messages=[{"role": "robot", "content": "x"}]), param="messages.0.role"),
    Case("image-part", 400, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
    Case(
        "n-zero",
        400,
        chat(n=0),
        param="n",
        contains=lambda: ["n: Input should be greater than or equal to 1"],
    ),
    Case("n-too-many", 400, chat(n=1000), param="n"),
    Case("temperature-negative", 400, chat(temperature=-1), param="temperature"),
    Case("temperature-string", 400, chat(temperature="hot"), param="temperature"),
    Case("top-p-two", 400, chat(top_p=2), param="top_p"),
    Case("presence-penalty-three", 400, chat(presence_penalty=3), param="presence_penalty"),
    Case("max-tokens-zero", 400, chat(max_tokens=0), param="max_tokens"),
    # strict JSON types, as OpenAI checks them: no string, boolean or float for an integer field
    Case("max-tokens-string", 400, chat(max_tokens="5"), param="max_tokens", contains=lambda: ["integer"]),
    Case("max-tokens-bool", 400, chat(max_tokens=True), param="max_tokens", contains=lambda: ["integer"]),
    Case("n-float", 400, chat(n=2.0), param="n"),
    Case("stream-string", 400, chat(stream="true"), param="stream", contains=lambda: ["boolean"]),
    Case("logit-bias-string-bias", 400, chat(logit_bias={"50": "5"}), param="logit_bias.50"),
    Case(
        "tools-same-name",
        400,
        chat(tools=[_tool("f"), _tool("f")]),
        param="tools",
        contains=lambda: ["two tools are named 'f'"],
    ),
    Case("min-tokens-above-max", 400, chat(max_tokens=4, min_tokens=8), param="min_tokens"),
    Case("unknown-model", 404, chat(model="gpt-17"), param="model", code="model_not_found"),
    Case("missing-key", 401, chat(), headers={}, code="invalid_api_key"),
    Case("wrong-key", 401, chat(), headers={"Authorization": "Bearer sk-wrong"}, code="invalid_api_key"),
    Case("body-too-large", 413, chat(messages=[{"role": "user", "content": "x" * MAX_REQUEST_BYTES}])),
    Case(
        "response-format-unknown-type",
        400,
        chat(response_format={"type": "yaml"}),
        param="response_format.type",
    ),
    Case("tool-message-without-content", 400, chat(messages=[{"role": "tool", "tool_call_id": "a"}])),
    Case("logit-bias-not-a-token-id", 400, chat(logit_bias={"fifty": 5}), param="logit_bias.fifty"),
    Case(
        "logit-bias-over-100",
        400,
        chat(logit_bias={"50": 101}),
        param="logit_bias.50",
        contains=lambda: ["100"],
    ),
    Case(
        "logit-bias-outside-vocab",
        400,
        lambda: chat(logit_bias={str(len(hf_tokenizer())): 5}),
        param="logit_bias",
        contains=lambda: [str(len(hf_tokenizer()))],
    ),
    Case(
        "generate-logit-bias-negative-id",
        400,
        {"text": "a", "sampling_params": {"logit_bias": {"-3": 1}}},
        path="/generate",
        param="sampling_params.logit_bias.-3",
    ),
    Case(
        "stream-options-without-stream",
        400,
        chat(stream_options={"include_usage": True}),
        param="stream_options",
    ),
    Case("top-logprobs-21", 400, chat(logprobs=True, top_logprobs=21), param="top_logprobs"),
    Case("top-logprobs-without-logprobs", 400, chat(top_logprobs=2), param="top_logprobs"),
    Case(
        "max-tokens-over-context",
        400,
        _too_long_for_context,
        param="messages",
        code="context_length_exceeded",
        contains=_context_numbers,
    ),
    Case("completion-logprobs-21", 400, completion(logprobs=21), path="/v1/completions", param="logprobs"),
    Case(
        "completion-max-tokens-0-without-echo",
        400,
        completion(max_tokens=0),
        path="/v1/completions",
        param="max_tokens",
    ),
    Case(
        "completion-prompt-logprobs-21",
        400,
        completion(prompt_logprobs=21),
        path="/v1/completions",
        param="prompt_logprobs",
    ),
    Case(
        "chat-prompt-logprobs-streamed",
        400,
        chat(prompt_logprobs=1, stream=True),
        param="prompt_logprobs",
    ),
    Case("completion-empty-prompt", 400, completion(prompt=[]), path="/v1/completions", param="prompt"),
    Case(
        "completion-prompt-over-context",
        400,
        lambda: completion(prompt=[1] * context_length()),
        path="/v1/completions",
        param="prompt",
        code="context_length_exceeded",
        contains=lambda: [str(context_length())],
    ),
    Case("completion-empty-text", 400, completion(prompt=""), path="/v1/completions", param="prompt"),
    Case(
        "completion-id-outside-vocab",
        400,
        lambda: completion(prompt=[len(hf_tokenizer())]),
        path="/v1/completions",
        param="prompt",
        contains=lambda: [str(len(hf_tokenizer()))],
    ),
    Case("completion-best-of", 400, completion(best_of=3), path="/v1/completions", param="best_of"),
    Case("generate-text-and-ids", 400, {"text": "a", "input_ids": [1]}, path="/generate", param="text"),
    Case("generate-empty-batch", 400, {"text": []}, path="/generate", param="text"),
    Case("generate-empty-text-in-batch", 400, {"text": ["a", ""]}, path="/generate", param="text.1"),
    Case(
        "generate-empty-ids-in-batch",
        400,
        {"input_ids": [[1], []]},
        path="/generate",
        param="input_ids.1",
        contains=lambda: ["batch is empty"],
    ),
    Case(
        "generate-top-p-zero",
        400,
        {"text": "a", "sampling_params": {"top_p": 0}},
        path="/generate",
        param="sampling_params.top_p",
    ),  # fmt: skip
    Case(
        "generate-two-grammars",
        400,
        {"text": "a", "sampling_params": {"regex": "a+", "ebnf": "root ::= 'a'"}},
        path="/generate",
        param="sampling_params.ebnf",
    ),  # fmt: skip
    # grammar and tool bounds (pdserve.sampling.bounds); their sizes: test_grammar_and_tool_sizes_are_bounded
    Case(
        "too-many-choices",
        400,
        chat(structured_outputs={"choice": ["a"] * (MAX_CHOICES + 1)}),
        param="structured_outputs.choice",
    ),
    Case("too-many-tools", 400, chat(tools=[_tool(f"f{i}") for i in range(MAX_TOOLS + 1)]), param="tools"),
    Case(
        "request-id-too-long", 400, chat(), headers={**AUTH, "X-Request-Id": "r" * 300}, param="X-Request-Id"
    ),
    Case(
        "request-id-not-ascii",
        400,
        chat(),
        headers={**AUTH, "X-Request-Id": "r\u00e9".encode("latin-1")},
        param="X-Request-Id",
        contains=lambda: ["must be printable ASCII"],
    ),
    Case(
        "lone-surrogate-in-message",
        400,
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
        contains=lambda: ["not valid Unicode", "\\ud800"],
    ),
    # json.dumps escapes them as \\uXXXX, as a JavaScript client sends them
    Case(
        "lone-surrogate-in-stop",
        400,
        json.dumps(chat(stop=["\ud83d"])).encode(),
        param="stop.0",
        contains=lambda: ["unicode string"],
    ),
    Case("lone-surrogate-tokenize", 400, json.dumps({"prompt": "a\udfff"}).encode(), path="/tokenize"),
    # an error message that echoes the client's text escapes what UTF-8 cannot carry (it was a 500)
    Case(
        "lone-surrogate-in-model",
        404,
        json.dumps(chat(model="gpt-\ud800")).encode(),
        param="model",
        contains=lambda: ["gpt-\\ud800"],
    ),
    Case(
        "lone-surrogate-in-rid",
        400,
        json.dumps({"text": "a", "rid": "r\ud800"}).encode(),
        path="/generate",
        param="rid",
    ),
    Case("load-lora-missing-key", 401, {}, path="/v1/load_lora_adapter", headers={}, code="invalid_api_key"),
    Case("load-lora-no-path", 400, {"lora_name": "a"}, path="/v1/load_lora_adapter", param="lora_path"),
    Case(
        "load-lora-extra-field",
        400,
        {"lora_name": "a", "lora_path": "/p", "x": 1},
        path="/v1/load_lora_adapter",
    ),
    Case(
        "unload-lora-unknown",
        404,
        {"lora_name": "nobody"},
        path="/v1/unload_lora_adapter",
        param="lora_name",
        code="model_not_found",
    ),
    Case("wrong-method", 405, None, method="GET"),
    Case("unknown-path", 404, {}, path="/v1/audio/transcriptions"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_bad_request(local_gateway, case: Case) -> None:
    body = case.body() if callable(case.body) else case.body
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    headers = {"Content-Type": "application/json", "X-Request-Id": f"bad-{case.id}", **case.headers}
    async with httpx.AsyncClient(base_url=local_gateway.base_url, timeout=30) as client:
        r = await client.request(case.method, case.path, headers=headers, **kwargs)
    assert r.status_code == case.status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if case.param is not None:
        assert error["param"] == case.param, error
    if case.code is not None:
        assert error["code"] == case.code, error
    for text in case.contains():
        assert text in error["message"], error["message"]
    if not case.id.startswith("request-id-"):  # a refused X-Request-Id is not echoed
        assert r.headers["x-request-id"] == f"bad-{case.id}"


SIZE_CASES = [
    (
        NativeGenerateRequest,
        {"text": "a", "sampling_params": {"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}},
        "sampling_params.regex",
    ),
    (
        ChatCompletionRequest,
        chat(response_format=_json_schema_format({"enum": ["x" * MAX_GRAMMAR_CHARS]})),
        "response_format.json_schema.schema",
    ),
    (
        ChatCompletionRequest,
        chat(structured_outputs={"grammar": "x" * (MAX_GRAMMAR_CHARS + 1)}),
        "structured_outputs.grammar",
    ),
    (
        ChatCompletionRequest,
        chat(tools=[_tool("f", {"type": "string", "description": "x" * MAX_GRAMMAR_CHARS})]),
        "tools.0.function.parameters",
    ),
    (
        ChatCompletionRequest,
        chat(
            tools=[
                _tool(f"f{i}", {"description": "x" * 60_000}) for i in range(MAX_TOOLS_CHARS // 60_000 + 1)
            ]
        ),
        "tools",
    ),
    (ChatCompletionRequest, chat(tools=[_tool("f", _nested({"type": "string"}, 40))]), "tools"),
    (ChatCompletionRequest, chat(chat_template_kwargs={"x": _nested([], 900)}), "chat_template_kwargs"),
    (ChatCompletionRequest, chat(chat_template_kwargs={"x": "y" * 70_000}), "chat_template_kwargs"),
]


@pytest.mark.parametrize(("model", "body", "param"), SIZE_CASES, ids=[c[2] for c in SIZE_CASES])
def test_grammar_and_tool_sizes_are_bounded(model, body: dict, param: str) -> None:
    """Grammar text, tools and template kwargs past their size or nesting bounds: the 400 HTTP and the
    gRPC API answer, naming the field (checked on the request models: such bodies are larger than the
    test gateway takes; nested ones would exhaust the chat template's recursion)."""
    with pytest.raises(GatewayError) as info:
        validate_as_body(model, body)
    assert info.value.status == 400
    assert info.value.param == param, info.value
    assert "at most" in info.value.message, info.value.message


async def test_valid_request_without_schedulers_is_503_with_retry_after(local_gateway) -> None:
    async with httpx.AsyncClient(base_url=local_gateway.base_url, headers=AUTH, timeout=30) as client:
        r = await client.post("/v1/chat/completions", json=chat(max_tokens=4))
        health = await client.get("/health")
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "service_unavailable"
    assert health.status_code == 503
    roles = health.json()["roles"]
    assert roles["tokenizer"] == {local_gateway.tokenizer_address: "SERVING"}
    assert set(roles["decode"].values()) == {"NOT_SERVING"}


async def test_still_serving_after_bad_requests(local_gateway) -> None:
    """After every case above (and in any order), the gateway answers normally."""
    async with httpx.AsyncClient(base_url=local_gateway.base_url, headers=AUTH, timeout=30) as client:
        for case in CASES[:5]:
            await client.post(case.path, content=b"{not json")
        models = await client.get("/v1/models")
        tokens = await client.post("/tokenize", json={"model": MODEL, "messages": HELLO})
        metrics = await client.get("/metrics")
    assert models.status_code == 200
    assert models.json()["data"][0] == {
        **models.json()["data"][0],
        "id": MODEL,
        "object": "model",
        "max_model_len": context_length(),
    }
    assert tokens.json() == {
        "tokens": chat_ids(HELLO),
        "count": len(chat_ids(HELLO)),
        "max_model_len": context_length(),
    }
    counted = {
        (s.labels["endpoint"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(metrics.text)
        for s in family.samples
        if s.name == "pdserve:gateway_requests_total" and s.labels["role"] == "gateway"
    }
    assert counted[("/v1/chat/completions", "400")] >= 1, counted
