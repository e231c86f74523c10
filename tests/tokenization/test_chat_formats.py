"""Tool-call and reasoning formats read from chat templates, and the default rendering of tools,
on the real SmolLM2 tokenizer (whose template does not render tools) and on templates set on it."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pdserve.model_source import resolve_model
from pdserve.tokenization import ChatMessage, Tokenizer
from pdserve.tokenization.chat_formats import reasoning_format, renders_tools, tool_call_format

LOOP = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
PROMPT = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
TOOLS = "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
def hf():
    return AutoTokenizer.from_pretrained(resolve_model())


@pytest.mark.parametrize(
    "template, expected",
    [
        (LOOP + PROMPT, "hermes"),  # no tools rendered: the default rendering, hermes
        (TOOLS + "<tool_call>" + LOOP + PROMPT, "hermes"),  # Qwen2.5, Hermes
        (TOOLS + "[TOOL_CALLS]" + LOOP + PROMPT, "mistral"),
        (TOOLS + "<|python_tag|>" + LOOP + PROMPT, "llama3"),
        (TOOLS + LOOP + PROMPT, ""),  # renders tools, in no format known here
    ],
)
def test_tool_call_format_follows_the_template(hf, template: str, expected: str) -> None:
    hf.chat_template = template
    assert tool_call_format(hf) == expected


def test_a_marker_among_the_added_tokens_names_the_format(hf) -> None:
    hf.chat_template = TOOLS + LOOP + PROMPT
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    assert tool_call_format(hf) == "mistral"


@pytest.mark.parametrize(
    "prompt, mention, expected",
    [
        ("<|im_start|>assistant\n", "", ""),
        ("<|im_start|>assistant\n<think>\n", "", "deepseek_r1"),  # DeepSeek-R1 opens the block
        ("<|im_start|>assistant\n", "{# <think> #}", "qwen3"),  # Qwen3 mentions it
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "", "qwen3"),  # thinking off: closed block
    ],
)
def test_reasoning_format_follows_the_generation_prompt(hf, prompt: str, mention: str, expected: str) -> None:
    hf.chat_template = mention + LOOP + "{% if add_generation_prompt %}" + prompt + "{% endif %}"
    assert reasoning_format(hf, think_tokens=False) == expected
    assert reasoning_format(hf, think_tokens=True) == (expected or "qwen3")


def test_renders_tools_reads_the_variable_not_the_word() -> None:
    assert renders_tools(TOOLS + LOOP)
    assert not renders_tools(LOOP + "{# the tools of the model #}")


def test_smollm2_gets_the_hermes_default_rendering(tokenizer: Tokenizer) -> None:
    """SmolLM2's template ignores tools: the tokenizer writes them, the call and its result into plain
    messages, which render as the same messages written by hand."""
    assert tokenizer.default_tools and tokenizer.info.tool_call_parser == "hermes"
    assert tokenizer.info.reasoning_parser == ""
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    chat = [
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", tool_calls=[call]),
        ChatMessage("tool", "18 C", tool_call_id="c1"),
        ChatMessage("tool", "sunny", tool_call_id="c1"),
    ]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tools=[WEATHER])
    system = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    by_hand = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        },
        {
            "role": "user",
            "content": "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>",
        },
    ]
    expected = tokenizer.hf.apply_chat_template(by_hand, add_generation_prompt=True, tokenize=False)
    assert prompt.text == expected
    assert prompt.input_ids == tokenizer.hf.encode(expected, add_special_tokens=False)
    # a system message keeps its text, the tools block after it; a chat without tools is as it was
    with_system = tokenizer.apply_chat_template(
        [ChatMessage("system", "Be brief."), chat[0]], tools=[WEATHER]
    )
    assert with_system.text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    plain = tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True)
    assert plain.text == tokenizer.hf.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"}], add_generation_prompt=True, tokenize=False
    )


def test_a_template_that_renders_tools_gets_them_itself() -> None:
    template = TOOLS + "<tool_call>" + LOOP + PROMPT
    tokenizer = Tokenizer.load(chat_template=template)
    assert not tokenizer.default_tools and tokenizer.info.tool_call_parser == "hermes"
    prompt = tokenizer.apply_chat_template([ChatMessage("user", "hi")], tools=[WEATHER])
    assert prompt.text == json.dumps(WEATHER) + "<tool_call><|im_start|>user\nhi<|im_end|>\n"
