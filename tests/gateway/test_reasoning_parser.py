"""Reasoning parsers on recorded outputs (DeepSeek-R1 and Qwen3 style), whole and streamed, and the
grammar that leaves the reasoning free and holds the answer."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from pdserve.services.gateway.openai.reasoning_parser import ReasoningParser
from pdserve.services.gateway.openai.structured_outputs import Constraint
from tests.reference import xgrammar_compiler

# (parser, continued assistant text or None, output, reasoning, answer)
CASES = [
    ("deepseek_r1", None, "The user wants 2+2.\nIt is 4.\n</think>\n\nThe answer is 4.",
     "The user wants 2+2.\nIt is 4.\n", "The answer is 4."),
    ("deepseek_r1", None, "<think>Short.</think>4", "Short.", "4"),
    ("deepseek_r1", None, "Still thinking when cut off", "Still thinking when cut off", ""),
    ("qwen3", None, "<think>\nLet me see.\n</think>\n\n{\"a\": 1}", "\nLet me see.\n", '{"a": 1}'),
    ("qwen3", None, "No reasoning here.", None, "No reasoning here."),
    ("qwen3", None, "\n\nNo reasoning, leading blank lines kept.", None,
     "\n\nNo reasoning, leading blank lines kept."),
    ("qwen3", None, "<", None, "<"),
    ("qwen3", "Sure. <think>", "I continue my thought.</think>Done.", "I continue my thought.", "Done."),
    ("qwen3", "<think>x</think>", "Plain.", None, "Plain."),
]  # fmt: skip


@pytest.mark.parametrize(("name", "continued", "text", "reasoning", "answer"), CASES)
def test_whole_and_streamed_split(name, continued, text, reasoning, answer) -> None:
    parser = ReasoningParser(name)
    in_reasoning = parser.starts_reasoning(continued)
    assert parser.split(text, in_reasoning) == (reasoning, answer)
    for step in (1, 2, 3, 7):
        stream = parser.stream(in_reasoning)
        pieces = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)] + [stream.finish()]
        assert "".join(p[0] for p in pieces) == (reasoning or "")
        assert "".join(p[1] for p in pieces) == answer


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningParser("o1")


def accepts(constraint: Constraint, text: str) -> bool:
    matcher = xgr.GrammarMatcher(xgrammar_compiler().compile_structural_tag(constraint.text))
    return matcher.accept_string(text) and matcher.accept_token(2) and matcher.is_terminated()


def test_grammar_applies_after_the_reasoning() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer = Constraint("json_schema", json.dumps(schema))
    r1 = ReasoningParser("deepseek_r1").constraint(answer, in_reasoning=True)
    assert accepts(r1, 'Anything {at all} goes here.</think>\n\n{"a": 1}')
    assert accepts(r1, '<think>Also with the tag.</think>{"a": 1}')
    assert not accepts(r1, 'Thinking.</think>{"a": "one"}')  # the answer still follows the schema
    assert not accepts(r1, '{"a": 1}')  # reasoning must end first
    qwen = ReasoningParser("qwen3").constraint(Constraint("regex", "(yes|no)"), in_reasoning=False)
    assert accepts(qwen, "<think>hmm</think>\nyes")
    assert accepts(qwen, "no")  # the reasoning block is optional
    assert not accepts(qwen, "<think>hmm</think>maybe")
