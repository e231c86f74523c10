"""What a chat request's output is made of: the plan (grammar, parsers) and its per-choice parse.

``plan_chat`` decides, before generation, how a /v1/chat/completions request is served: its
grammar (from ``response_format`` / ``structured_outputs``, or from the tools when ``tool_choice``
forces a call; wrapped so a reasoning block stays free text where the output may reason), whether
tool calls are parsed out, and whether the output starts inside a reasoning block. ``ChoiceParser``
then splits one choice's text into ``reasoning_content``, ``content`` and ``tool_calls``, whole
(``parse``) or streamed (``feed`` / ``finish``): the same parsers run either way, so a stream
carries the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.sampling.bounds import MAX_SCHEDULER_GRAMMAR_CHARS
from pdserve.services.gateway.errors import invalid_request
from pdserve.services.gateway.openai.protocol import ChatCompletionRequest
from pdserve.services.gateway.openai.reasoning_parser import ReasoningParser
from pdserve.services.gateway.openai.structured_outputs import Constraint
from pdserve.services.gateway.openai.tool_parsers import (
    HermesParser,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
)


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """How one chat request is generated and read back.

    Attributes:
        constraint: the grammar its output is held to, or None.
        tools: the tool-call format its output is parsed with (None: no tool calls).
        max_calls: 1 when ``parallel_tool_calls`` is false, else None (no limit).
        reasoning: the reasoning parser (None: no reasoning split).
        in_reasoning: the output starts inside a reasoning block.
    """

    constraint: Constraint | None = None
    tools: ToolParser | None = None
    max_calls: int | None = None
    reasoning: ReasoningParser | None = None
    in_reasoning: bool = False


def plan_chat(
    body: ChatCompletionRequest,
    tool_parser: ToolParser | None,
    reasoning: ReasoningParser | None,
    think_tokens: bool = False,
) -> ChatPlan:
    """The plan of ``body`` with these parsers (``ServingContext.chat_parsers``: the flags', else
    those the model's chat template implies) for a model whose vocabulary has ``<think>`` tokens
    (``think_tokens``) or not.

    A forced call ("required" or a named function) is held by a grammar in the tool-call format,
    so it works on any model: where the format is not recognised (``tool_parser`` None), in the
    hermes format, which the default tool rendering also shows the model.

    Raises:
        GatewayError: 400 when ``tool_choice`` is "auto" but the tool-call format is not
            recognised, ``tool_choice`` names a function not in ``tools``, a forced call meets
            another constraint or ``ignore_eos``, or the resulting grammar is too large.
    """
    choice = body.tool_choice or ("auto" if body.tools else "none")
    parse_tools = bool(body.tools) and choice != "none"
    if parse_tools and choice == "auto" and tool_parser is None:
        raise invalid_request(
            "tool_choice 'auto' needs the model's tool-call format, which its chat template does not "
            "show: start the server with --tool-call-parser (or send tool_choice 'required' or a "
            "named function, whose calls a grammar holds, or 'none' to only show the tools)",
            param="tool_choice",
        )
    if parse_tools and tool_parser is None:
        tool_parser = HermesParser()
    constraint = body.constraint
    if choice not in ("none", "auto"):
        constraint = _forced_calls(body, tool_parser, choice, constraint)
    continued = body.messages[-1].content if body.continue_final_message else None
    in_reasoning = reasoning is not None and reasoning.starts_reasoning(continued)
    if (
        constraint is not None
        and reasoning is not None
        and reasoning.may_reason(in_reasoning, think_tokens, body.chat_template_kwargs)
    ):
        constraint = reasoning.constraint(constraint, in_reasoning)
    if constraint is not None and len(constraint.text) > MAX_SCHEDULER_GRAMMAR_CHARS:
        raise invalid_request(
            f"the request's grammar has {len(constraint.text)} characters (tools' schemas included); "
            f"at most {MAX_SCHEDULER_GRAMMAR_CHARS}",
            param="tools",
        )
    return ChatPlan(
        constraint=constraint,
        tools=tool_parser if parse_tools else None,
        max_calls=None if body.parallel_tool_calls else 1,
        reasoning=reasoning,
        in_reasoning=in_reasoning,
    )


def _forced_calls(
    body: ChatCompletionRequest, parser: ToolParser, choice, constraint: Constraint | None
) -> Constraint:
    """The grammar of a response made only of calls ("required", or the named function)."""
    if constraint is not None:
        raise invalid_request(
            "a forced tool call cannot be combined with response_format or structured_outputs",
            param="tool_choice",
        )
    if body.ignore_eos:
        raise invalid_request("'ignore_eos' cannot be combined with a forced tool call", param="ignore_eos")
    tools = [Tool(t.function.name, t.function.parameters or {"type": "object"}) for t in body.tools]
    forced = None if choice == "required" else choice.function.name
    if forced is not None and forced not in {t.name for t in tools}:
        raise invalid_request(f"tool_choice names function {forced!r}, which is not in tools", "tool_choice")
    return parser.constraint(tools, forced, body.parallel_tool_calls)


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """One choice's output split: reasoning (or None), content (None when tool calls were parsed
    and no text came before them) and its tool calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class ChoiceParser:
    """Splits one choice's text as ``plan`` says, whole or as it streams."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self._reasoning = plan.reasoning.stream(plan.in_reasoning) if plan.reasoning else None
        self._tools = ToolCallStream(plan.tools, plan.max_calls) if plan.tools else None

    @property
    def called(self) -> bool:
        """Whether the streamed output has made tool calls (its finish reason is then "tool_calls")."""
        return self._tools is not None and self._tools.called

    def parse(self, text: str) -> ChoiceOutput:
        """The split of a whole output."""
        reasoning = None
        if self.plan.reasoning is not None:
            reasoning, text = self.plan.reasoning.split(text, self.plan.in_reasoning)
        if self.plan.tools is None:
            return ChoiceOutput(reasoning, text, [])
        parsed = self.plan.tools.parse(text)
        return ChoiceOutput(reasoning, parsed.content, parsed.tool_calls[: self.plan.max_calls])

    def feed(self, text: str) -> tuple[str, str, list[ToolCallDelta]]:
        """``(reasoning, content, tool-call pieces)`` of the next piece of a streamed output."""
        reasoning, answer = self._reasoning.feed(text) if self._reasoning else ("", text)
        content, calls = self._tools.feed(answer) if self._tools else (answer, [])
        return reasoning, content, calls

    def feed_piece(self, text: str, last: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """``feed`` of a streamed piece, and when it is the ``last``, what ``finish`` adds."""
        reasoning, content, calls = self.feed(text)
        if not last:
            return reasoning, content, calls
        more = self.finish()
        return reasoning + more[0], content + more[1], calls + more[2]

    def finish(self) -> tuple[str, str, list[ToolCallDelta]]:
        """What a stream still has to send once the output has ended."""
        reasoning, answer = self._reasoning.finish() if self._reasoning else ("", "")
        content, calls = self._tools.feed(answer) if self._tools else (answer, [])
        if self._tools is not None:
            more_content, more_calls = self._tools.finish()
            content, calls = content + more_content, calls + more_calls
        return reasoning, content, calls
