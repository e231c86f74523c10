"""Reasoning parsers: split a model's ``<think>...</think>`` block from its answer.

``--reasoning-parser`` picks the family's convention (as vLLM and SGLang name them):

- ``deepseek_r1``: the model starts reasoning at once (DeepSeek-R1's template opens ``<think>``
  in the prompt; a leading ``<think>`` in the output is accepted too); everything up to
  ``</think>`` is reasoning, all of it if ``</think>`` never comes.
- ``qwen3``: the output reasons only when it begins with ``<think>`` (Qwen3's hybrid thinking),
  or when the request continues an assistant message that left a ``<think>`` block open.

The same ``ReasoningStream`` splits streamed and whole outputs, so both give the same text. With a
grammar, the reasoning block stays free text and the grammar applies to the answer after it
(``constraint``), but only where the output may reason (``may_reason``), as in vLLM (whose grammar
starts after the end-of-reasoning token, or at the first token when the prompt already closed the
block) and SGLang (``require_reasoning``): a model without ``<think>`` tokens, or a request that
turns thinking off, gets its grammar from the first token.
"""

from __future__ import annotations

from typing import Any

from pdserve.services.common.chat_parser_args import REASONING_PARSERS
from pdserve.services.gateway.openai.structured_outputs import (
    Constraint,
    st_const,
    st_sequence,
    st_tag,
    structural_tag,
)
from pdserve.services.gateway.openai.tool_parsers.base import partial_marker_len

START, END = "<think>", "</think>"
_UNDECIDED, _REASONING, _ANSWER = "undecided", "reasoning", "answer"


class ReasoningParser:
    """One reasoning convention (``name`` in ``REASONING_PARSERS``; ValueError otherwise)."""

    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; one of {', '.join(REASONING_PARSERS)}")
        self.name = name

    def starts_reasoning(self, continued: str | None) -> bool:
        """Whether the output begins inside a reasoning block; ``continued`` is the text of the
        assistant message the request continues (``continue_final_message``), else None."""
        opened = continued is not None and continued.rfind(START) > continued.rfind(END)
        return self.name == "deepseek_r1" or opened

    def may_reason(self, in_reasoning: bool, think_tokens: bool, template_kwargs: dict | None) -> bool:
        """Whether the output may hold a reasoning block, which a grammar must then leave free.

        Args:
            in_reasoning: the output starts inside a block (``starts_reasoning``).
            think_tokens: the model's vocabulary has ``<think>`` and ``</think>`` tokens (a
                reasoning model; without them it does not open a block of its own).
            template_kwargs: the request's ``chat_template_kwargs``; ``enable_thinking: false``
                (Qwen3's switch: its template closes an empty block in the prompt) turns reasoning off.
        """
        thinking = (template_kwargs or {}).get("enable_thinking", True) is not False
        return in_reasoning or (think_tokens and thinking)

    def stream(self, in_reasoning: bool) -> ReasoningStream:
        return ReasoningStream(in_reasoning)

    def split(self, text: str, in_reasoning: bool) -> tuple[str | None, str]:
        """``(reasoning or None, answer)`` of a whole output."""
        stream = self.stream(in_reasoning)
        reasoning, answer = stream.feed(text)
        more_reasoning, more_answer = stream.finish()
        reasoning += more_reasoning
        return reasoning or None, answer + more_answer

    def constraint(self, answer: Constraint, in_reasoning: bool) -> Constraint:
        """A grammar that leaves the reasoning block free and holds the answer to ``answer``."""
        free = {"type": "any_text", "excludes": [START, END]}
        if in_reasoning:
            block = st_sequence({"type": "optional", "content": st_const(START)}, st_tag("", free, END))
        else:
            block = {"type": "optional", "content": st_tag(START, free, END)}
        gap: dict[str, Any] = {"type": "regex", "pattern": r"\s{0,2}"}
        return structural_tag(st_sequence(block, gap, answer.as_format()))


class ReasoningStream:
    """Splits one output, piece by piece, into reasoning and answer text.

    Text that might still be (the start of) a marker is held back until it is decided; the answer
    starts after the whitespace that follows ``</think>``.
    """

    def __init__(self, in_reasoning: bool) -> None:
        self.state = _REASONING if in_reasoning else _UNDECIDED
        self._leading = in_reasoning  # a leading <think> may still come (and is dropped)
        self._buffer = ""
        self._answer_started = False

    def feed(self, delta: str) -> tuple[str, str]:
        """Add ``delta``; returns the ``(reasoning, answer)`` text ready to send."""
        self._buffer += delta
        reasoning = answer = ""
        while True:
            if self.state == _UNDECIDED:
                if self._buffer.startswith(START):
                    self._buffer = self._buffer[len(START) :]
                    self.state = _REASONING
                elif START.startswith(self._buffer):
                    return reasoning, answer
                else:  # no reasoning block: the answer is the output as it is, leading space kept
                    self.state = _ANSWER
                    self._answer_started = True
            elif self.state == _REASONING:
                if self._leading:
                    if self._buffer.startswith(START):
                        self._buffer = self._buffer[len(START) :]
                    elif START.startswith(self._buffer):
                        return reasoning, answer
                    self._leading = False
                end = self._buffer.find(END)
                if end < 0:
                    keep = partial_marker_len(self._buffer, END)
                    reasoning += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return reasoning, answer
                reasoning += self._buffer[:end]
                self._buffer = self._buffer[end + len(END) :]
                self.state = _ANSWER
            else:
                if not self._answer_started:  # the blank lines between </think> and the answer
                    self._buffer = self._buffer.lstrip()
                    self._answer_started = bool(self._buffer)
                answer += self._buffer
                self._buffer = ""
                return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """At the end of the output: the text held back (an undecided start is answer)."""
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self.state == _REASONING else ("", rest)
