"""The default rendering of tools, for a chat template that does not render them (SmolLM2's).

It follows the hermes convention (Qwen2.5's template; Hermes 2 and 3): the offered tools go in a
block at the end of the system prompt (a system message of their own when the chat has none; the
template's default system prompt, if it has one, then gives way to it); an assistant turn's calls
become ``<tool_call>`` blocks after its text; tool results go back as a user turn of
``<tool_response>`` blocks (consecutive results in one turn). The template then renders plain
system, user and assistant messages: the model sees the tools it is offered and the calls and
results of earlier turns, and the gateway's ``hermes`` parser reads its calls.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from pdserve.tokenization.chat_template import ChatMessage, with_parsed_arguments

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system-prompt block that offers ``tools`` (OpenAI tool objects, one JSON line each)."""
    return TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def tool_call_block(call: dict[str, Any]) -> str:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` for an OpenAI tool call
    (``{"function": {"name", "arguments"}}``, arguments as JSON text or an object)."""
    function = with_parsed_arguments(call).get("function") or {}
    body = {"name": function.get("name"), "arguments": function.get("arguments", {})}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def with_default_tools(
    messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None
) -> list[ChatMessage]:
    """``messages`` with ``tools``, earlier calls and tool results written into plain messages (see
    the module docstring); messages without any of them are returned as they are."""
    out: list[ChatMessage] = []
    after_tool = False
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if after_tool:
                out[-1] = dataclasses.replace(out[-1], content=f"{out[-1].content}\n{block}")
            else:
                out.append(ChatMessage("user", block))
            after_tool = True
            continue
        after_tool = False
        if m.tool_calls:
            calls = "\n".join(tool_call_block(c) for c in m.tool_calls)
            m = dataclasses.replace(
                m, content=f"{m.content}\n{calls}" if m.content else calls, tool_calls=None
            )
        out.append(m)
    if tools:
        block = tools_prompt(tools)
        if out and out[0].role == "system":
            out[0] = dataclasses.replace(out[0], content=f"{out[0].content}\n\n{block}")
        else:
            out.insert(0, ChatMessage("system", block))
    return out
