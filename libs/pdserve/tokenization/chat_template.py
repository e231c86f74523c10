"""Render chat messages through a model's own chat template (Jinja, run by transformers)."""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import PreTrainedTokenizerBase


class ChatTemplateError(ValueError):
    """The messages, tools or template kwargs cannot be rendered by the model's chat template."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat turn; ``content`` is plain text, ``name`` is passed to the template when set.

    An assistant turn may carry ``tool_calls`` (OpenAI's shape: ``{"id", "type": "function",
    "function": {"name", "arguments"}}``) and a ``tool`` turn the ``tool_call_id`` it answers; both
    reach the template, which renders them its own way (or not at all).
    """

    role: str
    content: str
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [with_parsed_arguments(call) for call in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


def with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call whose JSON ``arguments`` string is parsed into an object, as chat templates
    expect (they serialise it with ``tojson``); arguments that are not JSON stay a string."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A templated prompt: the text the template produced and its token ids (int, < vocab size)."""

    text: str
    input_ids: list[int]


def load_chat_template(value: str) -> str:
    """``--chat-template``: the text of the file ``value`` names, or ``value`` itself when it is an
    inline Jinja template (it contains ``{{`` or ``{%``).

    Raises:
        ValueError: ``value`` is neither an existing file nor a Jinja template, or does not parse.
    """
    path = Path(value).expanduser()
    if "{{" not in value and "{%" not in value:
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
        value = path.read_text()
    try:
        ImmutableSandboxedEnvironment().parse(value)
    except TemplateError as e:
        raise ValueError(f"--chat-template does not parse as Jinja: {e}") from e
    return value


def render_chat(
    hf: PreTrainedTokenizerBase,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Render ``messages`` with ``hf``'s chat template and return the prompt text.

    ``continue_final_message`` leaves the last (assistant) message open, so generation continues
    its text; it excludes ``add_generation_prompt``. ``tools`` reach templates that read ``tools``;
    ``template_kwargs`` are extra template variables (e.g. ``enable_thinking``).

    Raises:
        ChatTemplateError: no messages, both prompt flags set, ``continue_final_message`` without an
            assistant message last, a kwarg that would override one of
            ``apply_chat_template``'s own parameters, or the template itself failing.
    """
    if not messages:
        raise ChatTemplateError("chat input needs at least one message")
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError("add_generation_prompt and continue_final_message exclude each other")
    if continue_final_message and messages[-1].role != "assistant":
        raise ChatTemplateError("continue_final_message needs an assistant message last")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(kwargs.keys() & _reserved_parameters(hf))
    if reserved:
        raise ChatTemplateError(f"chat template kwargs may not set {', '.join(reserved)}")
    try:
        text = hf.apply_chat_template(
            [m.to_template() for m in messages],
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except (TemplateError, ValueError, TypeError, KeyError, RecursionError) as e:  # Recursion: deep input
        raise ChatTemplateError(f"chat template failed: {e}") from e
    if not isinstance(text, str):
        raise ChatTemplateError(f"chat template returned {type(text).__name__}, expected text")
    return text


def _reserved_parameters(hf: PreTrainedTokenizerBase) -> set[str]:
    params = inspect.signature(hf.apply_chat_template).parameters.values()
    return {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}
