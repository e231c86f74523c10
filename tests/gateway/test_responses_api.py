"""/v1/responses without a model: the request bounds (400s naming the field, against the real
gateway and tokenizer of ``local_gateway``, which has no schedulers), the store's retention, the
chat request a Responses request becomes, and the typed events of a stream."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.sampling.bounds import MAX_TOOLS
from pdserve.services.gateway.errors import GatewayError, validate_as_body
from pdserve.services.gateway.openai.chat_output import ChoiceParser, plan_chat
from pdserve.services.gateway.openai.protocol import ChatCompletionRequest
from pdserve.services.gateway.openai.responses.items import FunctionCallItem
from pdserve.services.gateway.openai.responses.objects import ResponseObject, ResponseUsage, output_items
from pdserve.services.gateway.openai.responses.protocol import MAX_INPUT_ITEMS, ResponsesRequest
from pdserve.services.gateway.openai.responses.store import ResponseStore, StoredResponse
from pdserve.services.gateway.openai.responses.stream import ResponseStream
from pdserve.services.gateway.openai.tool_parsers import TOOL_PARSERS
from tests.gateway.conftest import API_KEY

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOOL = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}


def body(**fields) -> dict:
    return {"model": MODEL, "input": "Hello", **fields}


BAD = [
    ("empty-input", body(input=[]), "input"),
    ("item-type", body(input=[{"type": "web_search_call", "id": "x"}]), "input.0"),
    (
        "image-part",
        body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
        None,
    ),
    (
        "call-id-too-long",
        body(input=[{"type": "function_call_output", "call_id": "c" * 257, "output": "x"}]),
        None,
    ),
    ("builtin-tool", body(tools=[{"type": "web_search"}]), "tools.0.type"),
    ("tool-name", body(tools=[{**TOOL, "name": "get time"}]), "tools.0.name"),
    ("too-many-tools", body(tools=[{**TOOL, "name": f"f{i}"} for i in range(MAX_TOOLS + 1)]), "tools"),
    ("choice-without-tools", body(tool_choice="required"), "tool_choice"),
    ("choice-not-in-tools", body(tools=[TOOL], tool_choice={"type": "function", "name": "x"}), "tool_choice"),
    ("max-output-tokens", body(max_output_tokens=0), "max_output_tokens"),
    ("temperature", body(temperature=2.5), "temperature"),
    ("top-p", body(top_p=0), "top_p"),
    ("top-logprobs", body(top_logprobs=21), "top_logprobs"),
    ("include", body(include=["everything"]), "include.0"),
    ("metadata-pairs", body(metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
    ("metadata-value", body(metadata={"k": "v" * 513}), "metadata.k"),
    ("previous-id-too-long", body(previous_response_id="r" * 257), "previous_response_id"),
    ("schema-missing", body(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
    ("background", body(background=True), "background"),
    ("conversation", body(conversation="conv_1"), "conversation"),
    ("truncation-auto", body(truncation="auto"), "truncation"),
    ("stream-options-without-stream", body(stream_options={"include_obfuscation": False}), "stream_options"),
]


@pytest.mark.parametrize(("fields", "param"), [(b, p) for _, b, p in BAD], ids=[c for c, _, _ in BAD])
async def test_bad_responses_requests_are_400_naming_the_field(local_gateway, fields, param) -> None:
    async with httpx.AsyncClient(base_url=local_gateway.base_url, headers=AUTH, timeout=30) as client:
        r = await client.post("/v1/responses", json=fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_input_items_are_bounded() -> None:
    """(Past the test gateway's 64 KiB body limit, so checked on the model as the route does.)"""
    items = [{"role": "user", "content": "a"}]
    assert (
        len(validate_as_body(ResponsesRequest, body(input=items * MAX_INPUT_ITEMS)).input) == MAX_INPUT_ITEMS
    )
    with pytest.raises(GatewayError) as err:
        validate_as_body(ResponsesRequest, body(input=items * (MAX_INPUT_ITEMS + 1)))
    assert err.value.status == 400 and err.value.param == "input"


async def test_unknown_ids_are_404_and_a_valid_request_reaches_the_schedulers(local_gateway) -> None:
    async with httpx.AsyncClient(base_url=local_gateway.base_url, headers=AUTH, timeout=30) as client:
        follow_up = await client.post("/v1/responses", json=body(previous_response_id="resp_nope"))
        get = await client.get("/v1/responses/resp_nope")
        delete = await client.delete("/v1/responses/resp_nope")
        valid = await client.post("/v1/responses", json=body(tools=[TOOL], tool_choice="required"))
    assert follow_up.status_code == 404
    assert follow_up.json()["error"] == {
        "message": "Previous response with id 'resp_nope' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
    assert (get.status_code, delete.status_code) == (404, 404)
    assert get.json()["error"]["message"] == "Response with id 'resp_nope' not found."
    assert valid.status_code == 503, valid.text  # planned and submitted: no decode worker here


def test_the_store_keeps_the_most_recently_used_per_key_for_its_ttl() -> None:
    now = [0.0]
    store = ResponseStore(max_per_key=2, ttl_s=10.0, clock=lambda: now[0])
    entry = lambda: StoredResponse({}, [])
    for rid in ("a", "b"):
        store.put("k1", rid, entry())
    store.put("k2", "c", entry())
    assert store.get("k1", "a") is not None  # a used: b is now the least recently used
    store.put("k1", "d", entry())
    assert [store.get("k1", r) is not None for r in "abd"] == [True, False, True]
    assert store.get("k2", "a") is None and store.get("k1", "c") is None  # per key
    now[0] = 9.0
    assert store.get("k1", "a") is not None
    now[0] = 15.0  # d unused for 15 s, a for 6 s
    assert store.get("k1", "d") is None and store.get("k1", "a") is not None
    assert store.delete("k1", "a") and not store.delete("k1", "a")
    assert len(ResponseStore(max_per_key=0)) == 0
    empty = ResponseStore(max_per_key=0)
    empty.put(None, "x", entry())
    assert empty.get(None, "x") is None


def test_items_become_the_chat_request_of_the_same_meaning() -> None:
    request = ResponsesRequest.model_validate(
        body(
            instructions="Be brief.",
            input=[
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_text", "text": "18 C"}],
                },
                {
                    "role": "developer",
                    "content": [
                        {"type": "input_text", "text": "Now "},
                        {"type": "input_text", "text": "answer."},
                    ],
                },
            ],
            tools=[TOOL],
            tool_choice={"type": "function", "name": "get_time"},
            max_output_tokens=7,
            temperature=0.5,
            text={"format": {"type": "json_schema", "name": "t", "schema": {"type": "object"}}},
        )
    )
    context = [
        ResponsesRequest.model_validate(body(input=[{"role": "user", "content": "Time?"}])).input[0],
        ResponsesRequest.model_validate(
            body(
                input=[
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": "Let me see."}],
                    }
                ]
            )
        ).input[0],
        FunctionCallItem(call_id="c1", name="get_time", arguments='{"tz": "UTC"}'),
    ]
    chat = request.chat_request(context, request.input_items())
    expected = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Time?"},
                {
                    "role": "assistant",
                    "content": "Let me see.",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
                {"role": "developer", "content": "Now answer."},
            ],
            "tools": [
                {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
            ],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "t", "schema": {"type": "object"}},
            },
        }
    )
    assert chat.chat_prompt() == expected.chat_prompt()
    assert chat.sampling_params(False, 0) == expected.sampling_params(False, 0)
    assert chat.constraint == expected.constraint and chat.tool_choice == expected.tool_choice


def _types(events) -> list[str]:
    return [kind for kind, _ in events]


def test_a_stream_sends_typed_events_whose_output_equals_the_whole_parse() -> None:
    """Content, then two calls, fed in small pieces: the events open and close each item in order,
    the sequence numbers count up from 0, and the final response's items are the whole parse's."""
    request = ResponsesRequest.model_validate(body(tools=[TOOL]))
    chat = request.chat_request([], request.input_items())
    plan = plan_chat(chat, TOOL_PARSERS["hermes"](), None)
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n' + (
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    )
    stream, parser = ResponseStream(ResponseObject.start("resp_1", MODEL, request)), ChoiceParser(plan)
    events = stream.start()
    for i in range(0, len(text), 5):
        events += stream.feed(*parser.feed(text[i : i + 5]), [])
    events += stream.feed(*parser.finish(), [])
    events += stream.finish("stop", ResponseUsage.of(3, 40, 0))
    data = [json.loads(payload) for _, payload in events]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert all(d["type"] == kind for (kind, _), d in zip(events, data, strict=True))
    kinds = _types(events)
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    message_done = kinds.index("response.output_item.done")
    assert kinds[message_done - 2 : message_done] == [
        "response.output_text.done",
        "response.content_part.done",
    ]
    assert (
        kinds.count("response.output_item.added") == 3
        and kinds.count("response.function_call_arguments.done") == 2
    )
    assert kinds[-1] == "response.completed"
    assert "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta") == "Sure.\n"
    final = data[-1]["response"]
    whole = output_items(parser.parse(text), "stop", None)

    def without_ids(items: list[dict]) -> list[dict]:
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]

    assert without_ids(final["output"]) == without_ids([item.model_dump(mode="json") for item in whole])
    assert [i["arguments"] for i in final["output"][1:]] == ['{"tz": "UTC"}', '{"tz": "CET"}']
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 43
