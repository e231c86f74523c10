"""OpenAI compatibility of the gateway (``local_gateway``: real gateway + real tokenizer, no schedulers).

GET /v1/models/{model}, OpenAI request fields that are accepted and ignored or refused by name, and
the exact error bodies (message, type, param, code) of requests a new user gets wrong. A request that
passes validation ends with 503 here (no schedulers): that is how acceptance is checked.
Expected numbers come from the checkpoint's config.json and the HF tokenizer, not from the gateway.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.gateway.conftest import API_KEY
from tests.gateway.test_bad_requests import AUTH, HELLO, MODEL, chat, completion, context_length
from tests.reference import chat_ids, hf_tokenizer

INVALID = "invalid_request_error"


def aclient(local_gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{local_gateway.base_url}/v1", api_key=API_KEY, max_retries=0)


async def post(local_gateway, path: str, body: dict | list | None = None, **kwargs) -> httpx.Response:
    """POST ``body`` as JSON (NaN and inf written as JavaScript literals, as Python's json does)."""
    if body is not None:
        kwargs["content"] = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **AUTH, **kwargs.pop("headers", {})}
    async with httpx.AsyncClient(base_url=local_gateway.base_url, timeout=30) as client:
        return await client.post(path, headers=headers, **kwargs)


def assert_error(
    r: httpx.Response, status: int, message: str, param: str | None, code: str | None = None
) -> None:
    """``r`` is OpenAI's error body with exactly these fields (type invalid_request_error)."""
    assert r.status_code == status, r.text
    assert r.json() == {"error": {"message": message, "type": INVALID, "param": param, "code": code}}


def vocab_size() -> int:
    return len(hf_tokenizer())


# ---- GET /v1/models/{model} -------------------------------------------------------------------


async def test_retrieve_served_model_is_the_listed_card(local_gateway) -> None:
    client = aclient(local_gateway)
    model = await client.models.retrieve(MODEL)
    listed = (await client.models.list()).data
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "pdserve")
    assert isinstance(model.created, int) and model.created > 0
    assert [m.id for m in listed] == [model.id]
    assert model.model_dump(exclude={"created"}) == listed[0].model_dump(exclude={"created"})
    assert model.model_extra == {"max_model_len": context_length(), "parent": None}  # vLLM's fields


@pytest.mark.parametrize("model", ["gpt-17", "org/gpt-17"])
async def test_retrieve_unknown_model_is_404_model_not_found(local_gateway, model: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await aclient(local_gateway).models.retrieve(model)
    err = info.value
    assert err.status_code == 404
    assert err.body == {
        "message": f"The model '{model}' does not exist (served: '{MODEL}')",
        "type": INVALID,
        "param": "model",
        "code": "model_not_found",
    }


async def test_retrieve_model_needs_the_api_key(local_gateway) -> None:
    async with httpx.AsyncClient(base_url=local_gateway.base_url, timeout=30) as client:
        r = await client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"


# ---- OpenAI request fields ----------------------------------------------------------------------


async def test_harmless_openai_chat_fields_are_accepted(local_gateway) -> None:
    """store, metadata, service_tier, reasoning_effort, prediction, prompt_cache_key,
    safety_identifier, verbosity, unknown fields (ignored, as vLLM does) and the no-op values of
    the others."""
    with pytest.raises(openai.APIStatusError) as info:
        await aclient(local_gateway).chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=4,
            store=True,
            metadata={"team": "a", "run": "7"},
            service_tier="auto",
            reasoning_effort="low",
            prediction={"type": "content", "content": "Hi"},
            modalities=["text"],
            audio=None,
            web_search_options=None,
            functions=[],
            function_call="none",
            prompt_cache_key="session-7",
            safety_identifier="user-1",
            verbosity="low",
            extra_body={"best_guess": True, "future_option": {"x": 1}},
        )
    assert info.value.status_code == 503, info.value.body  # validated, then no scheduler
    assert info.value.body["type"] == "service_unavailable"


async def test_unknown_completion_fields_and_message_fields_are_accepted(local_gateway, caplog) -> None:
    """A completions request with fields this server does not know, and a chat whose messages
    carry fields a client copied from a response (refusal, annotations): accepted, ignored and
    logged by name (as vLLM does)."""
    for path, body, ignored in (
        ("/v1/completions", completion(store=True, best_guess=1, prompt_cache_key="k"), "best_guess, store"),
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": "hi", "refusal": None, "annotations": []}]),
            "messages.0.annotations, messages.0.refusal",
        ),
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pdserve.services.gateway.openai.serving_common"):
            r = await post(local_gateway, path, body, headers={"X-Request-Id": "unknown-fields"})
        assert r.status_code == 503, r.text  # validated, then no scheduler
        assert f"request unknown-fields: ignoring unknown fields {ignored}" in caplog.messages


@dataclass
class Rejected:
    id: str
    body: dict
    message: str
    param: str


REJECTED = [
    Rejected(
        "modalities-audio",
        chat(modalities=["text", "audio"]),
        "'modalities' must be ['text'] (got ['text', 'audio']): this server generates text only",
        "modalities",
    ),
    Rejected(
        "audio",
        chat(audio={"voice": "alloy", "format": "wav"}),
        "'audio' is not supported: this server generates text only (no audio output)",
        "audio",
    ),
    Rejected(
        "web-search-options",
        chat(web_search_options={}),
        "'web_search_options' is not supported: this server does not search the web",
        "web_search_options",
    ),
    Rejected(
        "functions",
        chat(functions=[{"name": "f", "parameters": {}}]),
        "'functions' is not supported: legacy function calling is not served; "
        "send 'tools' and 'tool_choice' instead",
        "functions",
    ),
    Rejected(
        "function-call",
        chat(function_call={"name": "f"}),
        "'function_call' is not supported: legacy function calling is not served; "
        "send 'tools' and 'tool_choice' instead",
        "function_call",
    ),
    Rejected(
        "metadata-not-str",
        chat(metadata={"run": 7}),
        "metadata.run: Input should be a valid string",
        "metadata.run",
    ),
    Rejected(
        "structured-outputs-two-kinds",
        chat(structured_outputs={"regex": "a+", "choice": ["a"]}),
        "structured_outputs: give exactly one of json, regex, choice, grammar, json_object, "
        "structural_tag (got ['regex', 'choice'])",
        "structured_outputs",
    ),
    Rejected(
        "structured-outputs-unknown-kind",
        completion(structured_outputs={"lark": "start: 'a'"}),
        "structured_outputs.lark: Extra inputs are not permitted",
        "structured_outputs.lark",
    ),
    Rejected(
        "response-format-and-structured-outputs",
        chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
        "give either response_format or structured_outputs, not both",
        "structured_outputs",
    ),
    Rejected(
        "json-schema-without-schema",
        chat(response_format={"type": "json_schema"}),
        "response_format.json_schema: response_format type 'json_schema' needs 'json_schema'",
        "response_format.json_schema",
    ),
    Rejected(
        "schema-not-json",
        chat(structured_outputs={"json": "{not json"}),
        "structured_outputs.json: the schema is not valid JSON: Expecting property name enclosed in "
        "double quotes: "
        "line 1 column 2 (char 1)",
        "structured_outputs.json",
    ),
    Rejected(
        "grammar-with-ignore-eos",
        completion(structured_outputs={"regex": "a"}, ignore_eos=True),
        "'ignore_eos' cannot be combined with a constrained output",
        "ignore_eos",
    ),
    Rejected(
        "too-many-choices",
        chat(structured_outputs={"choice": ["a"] * 257}),
        "structured_outputs.choice: List should have at most 256 items after validation, not 257",
        "structured_outputs.choice",
    ),
    Rejected(
        "tool-choice-without-tools",
        chat(tool_choice="required"),
        "'tool_choice' names a tool call but 'tools' is empty",
        "tool_choice",
    ),
    Rejected(
        "tool-name-not-allowed",
        chat(tools=[{"type": "function", "function": {"name": "get weather"}}], tool_choice="none"),
        "tools.0.function.name: String should match pattern '^[a-zA-Z0-9_.-]{1,64}$'",
        "tools.0.function.name",
    ),
    Rejected(
        "tool-call-on-a-user-message",
        chat(
            messages=[
                {
                    "role": "user",
                    "content": "hi",
                    "tool_calls": [{"function": {"name": "f", "arguments": ""}}],
                }
            ]
        ),
        "only an assistant message carries 'tool_calls'",
        "tool_calls",
    ),
]


@pytest.mark.parametrize("case", REJECTED, ids=[c.id for c in REJECTED])
async def test_output_changing_fields_are_rejected_by_name(local_gateway, case: Rejected) -> None:
    path = "/v1/completions" if "prompt" in case.body else "/v1/chat/completions"
    assert_error(await post(local_gateway, path, case.body), 400, case.message, case.param)


# ---- error messages ----------------------------------------------------------------------------


async def test_chat_max_tokens_over_context_is_context_length_exceeded(local_gateway) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await aclient(local_gateway).chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=context_length()
        )
    p, c = len(chat_ids(HELLO)), context_length()
    assert info.value.status_code == 400
    assert info.value.body == {
        "message": f"This model's maximum context length is {c} tokens. However, you requested {p + c} "
        f"tokens ({p} in the prompt, {c} for the completion). Please reduce the length of the prompt "
        "or the completion.",
        "type": INVALID,
        "param": "messages",
        "code": "context_length_exceeded",
    }


async def test_chat_prompt_over_context_is_context_length_exceeded(local_gateway) -> None:
    messages = [{"role": "user", "content": " a" * context_length()}]
    r = await post(local_gateway, "/v1/chat/completions", chat(messages=messages))
    p, c = len(chat_ids(messages)), context_length()
    assert p >= c
    message = f"This model's maximum context length is {c} tokens, but the prompt has {p} tokens. "
    assert_error(r, 400, message + "Please shorten the prompt.", "messages", "context_length_exceeded")


async def test_completion_over_context_is_context_length_exceeded(local_gateway) -> None:
    c = context_length()
    r = await post(local_gateway, "/v1/completions", completion(prompt=[1] * c))
    message = f"This model's maximum context length is {c} tokens, but the prompt has {c} tokens. "
    assert_error(r, 400, message + "Please shorten the prompt.", "prompt", "context_length_exceeded")
    r = await post(local_gateway, "/v1/completions", completion(prompt=[1, 2], max_tokens=c))
    message = (
        f"This model's maximum context length is {c} tokens. However, you requested {c + 2} tokens "
        f"(2 in the prompt, {c} for the completion). Please reduce the length of the prompt or the "
        "completion."
    )
    assert_error(r, 400, message, "prompt", "context_length_exceeded")


NOT_AN_OBJECT = "the request body must be a JSON object (sent with Content-Type: application/json)"


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"hello", "application/x-www-form-urlencoded"),
        (b"model=x&prompt=y", "application/x-www-form-urlencoded"),
        (b'"hello"', "application/json"),
        (b"[1, 2, 3]", "application/json"),
        (b"null", "application/json"),
    ],
    ids=["form-text", "form-fields", "json-string", "json-array", "json-null"],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_body_that_is_not_a_json_object(
    local_gateway, path: str, content: bytes, content_type: str
) -> None:
    r = await post(local_gateway, path, content=content, headers={"Content-Type": content_type})
    assert_error(r, 400, NOT_AN_OBJECT, None)


@pytest.mark.parametrize(
    ("prompt", "bad"),
    [([-1], -1), ([5, -3, 7], -3), ([[5], [6, -2]], -2)],
    ids=["single", "among-valid", "in-batch"],
)
@pytest.mark.parametrize("echo", [False, True])
async def test_negative_token_id_is_outside_vocabulary(
    local_gateway, prompt: list, bad: int, echo: bool
) -> None:
    r = await post(local_gateway, "/v1/completions", completion(prompt=prompt, echo=echo))
    assert_error(r, 400, f"token id {bad} is outside the vocabulary [0, {vocab_size()})", "prompt")


async def test_token_id_above_vocabulary_with_echo(local_gateway) -> None:
    r = await post(local_gateway, "/v1/completions", completion(prompt=[vocab_size()], echo=True))
    assert_error(r, 400, f"token id {vocab_size()} is outside the vocabulary [0, {vocab_size()})", "prompt")


NON_FINITE = [
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", float("nan")),
    ("frequency_penalty", float("-inf")),
    ("presence_penalty", float("nan")),
    ("min_p", float("nan")),
    ("repetition_penalty", float("inf")),
]


@pytest.mark.parametrize(("name", "value"), NON_FINITE, ids=[f"{n}-{v}" for n, v in NON_FINITE])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_non_finite_sampling_value(local_gateway, path: str, name: str, value: float) -> None:
    body = chat(**{name: value}) if path == "/v1/chat/completions" else completion(**{name: value})
    assert_error(await post(local_gateway, path, body), 400, f"{name}: Input should be a finite number", name)


async def test_non_finite_native_sampling_value(local_gateway) -> None:
    body = {"text": "a", "sampling_params": {"temperature": float("inf")}}
    r = await post(local_gateway, "/generate", body)
    param = "sampling_params.temperature"
    assert_error(r, 400, f"{param}: Input should be a finite number", param)
