"""How a chat request is planned (its grammar, its parsers) and how its choices are read back."""

from __future__ import annotations

import json

import pytest

from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.openai.chat_output import ChoiceParser, plan_chat
from pdserve.services.gateway.openai.protocol import ChatCompletionRequest
from pdserve.services.gateway.openai.reasoning_parser import ReasoningParser
from pdserve.services.gateway.openai.tool_parsers import TOOL_PARSERS

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
HERMES = TOOL_PARSERS["hermes"]()


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_plain_requests_have_no_grammar_and_no_tool_parsing() -> None:
    plan = plan_chat(body(), HERMES, None)
    assert plan.constraint is None and plan.tools is None
    assert plan_chat(body(tools=[TOOL], tool_choice="none"), None, None).tools is None


def test_auto_needs_a_known_format_and_forced_calls_do_not() -> None:
    """With no format known (a template that shows tools its own way, no flag), "auto" is a 400;
    a forced call is held by a grammar in the hermes format (that of the default tool rendering)."""
    with pytest.raises(GatewayError) as err:
        plan_chat(body(tools=[TOOL]), None, None)
    assert err.value.status == 400 and "--tool-call-parser" in err.value.message
    auto = plan_chat(body(tools=[TOOL]), HERMES, None)
    assert auto.tools is HERMES and auto.constraint is None
    forced = plan_chat(body(tools=[TOOL], tool_choice="required"), None, None)
    assert forced.tools.name == "hermes"
    assert forced.constraint == plan_chat(body(tools=[TOOL], tool_choice="required"), HERMES, None).constraint


def test_forced_calls_get_a_grammar_from_the_tools() -> None:
    required = plan_chat(body(tools=[TOOL], tool_choice="required", parallel_tool_calls=False), HERMES, None)
    assert required.constraint.kind == "structural_tag" and required.max_calls == 1
    named = plan_chat(
        body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_time"}}), HERMES, None
    )
    begin = json.loads(named.constraint.text)["format"]["begin"]
    assert begin == '<tool_call>\n{"name": "get_time", "arguments": '


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
        ({"tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_impossible_tool_choices_are_400(fields, message) -> None:
    with pytest.raises(GatewayError) as err:
        plan_chat(body(tools=[TOOL], **fields), HERMES, None)
    assert err.value.status == 400 and message in err.value.message


def test_a_grammar_over_the_bound_is_400() -> None:
    # 128 tools of 68 properties: 254k characters of tools (under their 256 KiB bound), but their
    # grammar (each call's tag and schema) is over the 256 KiB a scheduler compiles
    params = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(68)}}
    tools = [
        {"type": "function", "function": {"name": f"t{j:063d}", "parameters": params}} for j in range(128)
    ]
    with pytest.raises(GatewayError) as err:
        plan_chat(body(tools=tools, tool_choice="required"), HERMES, None)
    assert "at most 262144" in err.value.message


def test_reasoning_wraps_the_grammar_only_where_the_output_may_reason() -> None:
    schema = {"response_format": {"type": "json_object"}}
    qwen = ReasoningParser("qwen3")
    plain = plan_chat(body(**schema), None, qwen)  # no <think> tokens: the grammar holds from token one
    assert plain.constraint.kind == "json_schema" and not plain.in_reasoning
    thinker = plan_chat(body(**schema), None, qwen, think_tokens=True)
    assert thinker.constraint.kind == "structural_tag" and not thinker.in_reasoning
    off = body(chat_template_kwargs={"enable_thinking": False}, **schema)
    assert plan_chat(off, None, qwen, think_tokens=True).constraint.kind == "json_schema"
    continued = body(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>"}],
        add_generation_prompt=False,
        continue_final_message=True,
        **schema,
    )
    opened = plan_chat(continued, None, qwen)
    assert opened.in_reasoning and opened.constraint.kind == "structural_tag"
    deepseek = plan_chat(body(**schema), None, ReasoningParser("deepseek_r1"))
    assert deepseek.in_reasoning and deepseek.constraint.kind == "structural_tag"


OUTPUT = (
    "Need the time.</think>\n\nOk. <tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
)


def test_a_choice_reads_the_same_whole_or_streamed() -> None:
    plan = plan_chat(body(tools=[TOOL]), HERMES, ReasoningParser("deepseek_r1"))
    whole = ChoiceParser(plan).parse(OUTPUT)
    assert whole.reasoning == "Need the time."
    assert whole.content == "Ok. "
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("get_time", {"tz": "UTC"})]
    for step in (1, 4, 9):
        parser = ChoiceParser(plan)
        pieces = [parser.feed(OUTPUT[i : i + step]) for i in range(0, len(OUTPUT), step)] + [parser.finish()]
        assert "".join(p[0] for p in pieces) == whole.reasoning
        assert "".join(p[1] for p in pieces) == whole.content
        assert "".join(d.arguments for p in pieces for d in p[2]) == whole.tool_calls[0].arguments
        assert parser.called
