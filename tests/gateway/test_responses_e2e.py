"""The Responses API end to end on SmolLM2, through the official ``openai`` client's ``responses``.

A Responses request is served as the chat request of the same meaning, so its greedy output must be
that chat request's, token for token: plain text, streamed or not, with logprobs, a JSON schema, a
forced function call, a tool-result turn and a ``previous_response_id`` follow-up (whose chat
request is written out by hand here). ``colocated`` is the session stack (no chat-parser flags);
the two-key test runs a second gateway on its workers.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.gateway.conftest import replica_of
from tests.gateway.schemas import SCHEMAS
from tests.stack import SERVED_MODEL, Stack

INSTRUCTIONS = "You are a geography teacher."
QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
KEY_A, KEY_B = "sk-responses-a", "sk-responses-b"


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, timeout=300)


def chat_answer(stack: Stack, messages: list[dict], **fields):
    return client(stack).chat.completions.create(
        model=SERVED_MODEL, messages=messages, temperature=0, **fields
    )


def test_a_response_is_the_chat_answer_and_is_stored(colocated) -> None:
    response = client(colocated).responses.create(
        model=SERVED_MODEL, input=QUESTION, instructions=INSTRUCTIONS, temperature=0, max_output_tokens=24
    )
    chat = chat_answer(
        colocated,
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].role == "assistant" and response.output[0].content[0].type == "output_text"
    finished = chat.choices[0].finish_reason
    assert response.status == {"stop": "completed", "length": "incomplete"}[finished]
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert (response.instructions, response.max_output_tokens, response.temperature) == (INSTRUCTIONS, 24, 0)
    stored = client(colocated).responses.retrieve(response.id)
    assert stored.model_dump() == response.model_dump()
    client(colocated).responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client(colocated).responses.retrieve(response.id)


def test_a_streamed_response_sends_typed_events_that_add_up_to_the_whole(colocated) -> None:
    kwargs = dict(model=SERVED_MODEL, input=QUESTION, temperature=0, max_output_tokens=16, store=False)
    whole = client(colocated).responses.create(**kwargs)
    events = list(client(colocated).responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(e.delta for e in deltas) == whole.output_text
    assert len({e.item_id for e in deltas}) == 1 and deltas[0].item_id == events[2].item.id
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    with pytest.raises(openai.NotFoundError):  # store=False
        client(colocated).responses.retrieve(events[-1].response.id)


def test_logprobs_and_a_json_schema_format(colocated) -> None:
    with_logprobs = client(colocated).responses.create(
        model=SERVED_MODEL, input=QUESTION, temperature=0, max_output_tokens=8, top_logprobs=2,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    chat = chat_answer(
        colocated, [{"role": "user", "content": QUESTION}], max_tokens=8, logprobs=True, top_logprobs=2
    )
    text = with_logprobs.output[0].content[0]
    assert [lp.model_dump() for lp in text.logprobs] == [
        lp.model_dump() for lp in chat.choices[0].logprobs.content
    ]
    name, schema = SCHEMAS[0]
    structured = client(colocated).responses.create(
        model=SERVED_MODEL, input="Describe a person.", temperature=0, max_output_tokens=96,
        text={"format": {"type": "json_schema", "name": name, "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(structured.output_text), schema)
    assert structured.text.format.type == "json_schema"


def test_a_function_call_its_result_and_a_follow_up(colocated) -> None:
    """A forced call (streamed and not), its result sent back with ``previous_response_id``: the
    follow-up's answer is that of the whole conversation written as one chat request."""
    question = "What is the weather in Paris?"
    kwargs = dict(
        model=SERVED_MODEL, input=question, tools=[WEATHER], tool_choice="required", temperature=0,
        max_output_tokens=64, parallel_tool_calls=False,
    )  # fmt: skip
    first = client(colocated).responses.create(**kwargs)
    assert [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client(colocated).responses.create(stream=True, **kwargs))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(pieces) > 1 and "".join(pieces) == done.arguments == call.arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[0].name == "get_weather"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}
    follow_up = client(colocated).responses.create(
        model=SERVED_MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER], temperature=0,
        max_output_tokens=24,
    )  # fmt: skip
    assert follow_up.previous_response_id == first.id
    called = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    conversation = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [called]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees and sunny"},
    ]
    chat = chat_answer(colocated, conversation, tools=[CHAT_WEATHER], max_tokens=24)
    assert follow_up.output_text == (chat.choices[0].message.content or "")
    # the same turn sent as items (the first response's output echoed back) reads the same
    turn = [{"role": "user", "content": question}, call.model_dump(exclude_none=True), result]
    echoed = client(colocated).responses.create(
        model=SERVED_MODEL, input=turn, tools=[WEATHER], temperature=0, max_output_tokens=24
    )
    assert echoed.output_text == follow_up.output_text


def test_auto_calls_a_tool_after_a_turn_that_did(colocated) -> None:
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "c0", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"role": "user", "content": "What is the weather in London?"},
    ]
    response = client(colocated).responses.create(
        model=SERVED_MODEL, input=history, tools=[WEATHER], temperature=0, max_output_tokens=48
    )
    assert [item.type for item in response.output] == ["function_call"]
    assert json.loads(response.output[0].arguments) == {"city": "London"}


async def test_a_stored_response_belongs_to_the_key_that_made_it(colocated) -> None:
    async with replica_of(colocated, "--api-key", f"{KEY_A},{KEY_B}") as replica:
        url = f"http://127.0.0.1:{replica.http_port}/v1"
        a, b = (
            openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=300)
            for key in (KEY_A, KEY_B)
        )
        first = await a.responses.create(
            model=SERVED_MODEL, input=QUESTION, temperature=0, max_output_tokens=4
        )
        with pytest.raises(openai.NotFoundError) as err:
            await b.responses.retrieve(first.id)
        assert err.value.body == {
            "message": f"Response with id '{first.id}' not found.", "type": "invalid_request_error",
            "param": None, "code": None,
        }  # fmt: skip
        with pytest.raises(openai.NotFoundError) as err:
            await b.responses.create(
                model=SERVED_MODEL, previous_response_id=first.id, input="And of Italy?", max_output_tokens=4
            )
        assert err.value.body["param"] == "previous_response_id"
        assert err.value.body["code"] == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            await b.responses.delete(first.id)
        again = await a.responses.create(
            model=SERVED_MODEL,
            previous_response_id=first.id,
            input="And of Italy?",
            temperature=0,
            max_output_tokens=4,
        )
        assert again.status in ("completed", "incomplete")
        assert (await a.responses.retrieve(first.id)).output_text == first.output_text
