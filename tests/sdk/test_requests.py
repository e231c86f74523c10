"""Request building: the SDK's GenerateRequest bytes as the server's own generated code parses them."""

from __future__ import annotations

import json

import pytest
from google.protobuf.json_format import MessageToDict
from pdserve_sdk.requests import chat_request, generate_request

from pdserve.v1 import api_pb2


def as_server_sees(request) -> dict:
    """Parse the SDK's wire bytes with the server's generated ``pdserve.v1`` classes."""
    parsed = api_pb2.GenerateRequest.FromString(request.SerializeToString())
    return MessageToDict(parsed, preserving_proto_field_name=True)


def test_text_prompt_with_sampling():
    request = generate_request(
        "Hello", None, "default-model", {"temperature": 0.0, "max_new_tokens": 5, "stop": "\n", "seed": 7}
    )
    assert as_server_sees(request) == {
        "model": "default-model",
        "text": "Hello",
        # temperature 0 is kept: the field is proto3 optional, so "set to 0" differs from "unset"
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 5, "stop": ["\n"], "seed": "7"},
    }


def test_speculation_opt_out_is_sent_as_set():
    request = generate_request("Hello", None, "m", {"speculative_num_draft_tokens": 0})
    # proto3 optional: 0 (opt out of speculation) differs from unset (the server's default)
    assert as_server_sees(request)["sampling_params"] == {"speculative_num_draft_tokens": 0}


def test_input_ids_rid_and_model_override():
    request = generate_request(
        None, [1, 2, 3], "default-model", {"model": "other", "rid": "r1", "top_k": None}
    )
    assert as_server_sees(request) == {
        "rid": "r1",
        "model": "other",
        "input_ids": {"ids": [1, 2, 3]},
        "sampling_params": {},
    }


def test_chat_request_renders_messages_and_template_options():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ann"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    request = chat_request(messages, "", {"tools": tools, "chat_template_kwargs": {"x": 1}, "n": 2})
    seen = as_server_sees(request)
    assert seen["chat"]["messages"] == messages
    assert seen["chat"]["add_generation_prompt"] is True
    assert "continue_final_message" not in seen["chat"]
    assert json.loads(seen["chat"]["tools_json"]) == tools
    assert json.loads(seen["chat"]["chat_template_kwargs_json"]) == {"x": 1}
    assert seen["sampling_params"] == {"n": 2}
    continued = chat_request(messages, "", {"add_generation_prompt": False, "continue_final_message": True})
    assert as_server_sees(continued)["chat"]["continue_final_message"] is True
    assert "add_generation_prompt" not in as_server_sees(continued)["chat"]


def test_grammars_and_tool_turns_reach_the_server():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = generate_request("Hi", None, "", {"json_schema": schema, "temperature": 0.0})
    assert json.loads(as_server_sees(request)["sampling_params"]["json_schema"]) == schema
    assert as_server_sees(generate_request("Hi", None, "", {"regex": "a+"}))["sampling_params"] == {
        "regex": "a+"
    }
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    turns = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2", "tool_call_id": "call_1"},
    ]
    seen = as_server_sees(chat_request(turns, "", {}))["chat"]["messages"]
    assert json.loads(seen[0]["tool_calls_json"]) == [call]
    assert seen[1] == {"role": "tool", "content": "2", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    ("prompt", "input_ids", "kwargs", "match"),
    [
        (None, None, {}, "exactly one of prompt and input_ids"),
        ("a", [1], {}, "exactly one of prompt and input_ids"),
        ("a", None, {"max_tokens": 3}, r"unknown parameter\(s\): max_tokens \(the SDK's is max_new_tokens\)"),
        ("a", None, {"top_logprobs": 3, "bogus": 1}, r"bogus, top_logprobs \(the SDK's is top_logprobs_num"),
        ("a", None, {"temperature": "hot"}, "temperature='hot'"),
    ],
)
def test_bad_arguments_raise_type_error(prompt, input_ids, kwargs, match):
    with pytest.raises(TypeError, match=match):
        generate_request(prompt, input_ids, "", kwargs)


def test_text_that_is_not_unicode_raises_value_error_naming_the_parameter():
    with pytest.raises(ValueError, match="sampling parameter stop="):
        generate_request("a", None, "", {"stop": ["\ud800"]})


def test_chat_text_parts_are_sent_joined():
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    seen = as_server_sees(chat_request([{"role": "user", "content": parts}], "", {}))
    assert seen["chat"]["messages"] == [{"role": "user", "content": "Hi there"}]


@pytest.mark.parametrize(
    ("message", "error", "match"),
    [
        ({"role": "user", "text": "hi"}, TypeError, r"messages\[1\]: .*keys role, content"),
        ("hi", TypeError, r"messages\[1\]: .*got str"),
        ({"role": "user", "content": None}, TypeError, r"messages\[1\]: content must be a string or a list"),
        ({"role": 1, "content": "hi"}, TypeError, r"messages\[1\]: role must be a string"),
        ({"role": "user", "content": "hi", "name": 2}, TypeError, r"messages\[1\]: name must be a string"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            ValueError,
            r"messages\[1\]: content\[0\] is not a text part",
        ),
        (
            {"role": "user", "content": [{"type": "text", "text": 5}]},
            ValueError,
            r"messages\[1\]: content\[0\]",
        ),
        ({"role": "user", "content": ["hi"]}, ValueError, r"messages\[1\]: content\[0\]"),
        ({"role": "user", "content": "\ud800"}, ValueError, r"messages\[1\]: .*surrogates"),
    ],
)
def test_bad_chat_message_names_its_index(message, error, match):
    with pytest.raises(error, match=match):
        chat_request([{"role": "system", "content": "Be brief."}, message], "", {})
