"""Tool-call parsers on outputs in each format (well-formed and malformed), whole and streamed, and
the grammars they write: every forced-call grammar accepts its format's call and rejects others."""

from __future__ import annotations

import json

import pytest

from pdserve.services.gateway.openai.tool_parsers import TOOL_PARSERS, Tool, ToolCallStream, ToolParser
from tests.reference import hf_tokenizer, xgrammar_compiler

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [Tool("get_weather", WEATHER), Tool("get_time", {"type": "object"})]

# Outputs as the model families write them (Qwen2.5 / Hermes, Llama 3.1, Mistral), then malformed ones.
RECORDED = {
    "hermes": [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
            None,
            [("get_weather", {"city": "Paris", "days": 3})],
        ),
        (
            "Let me check both.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            "Let me check both.\n",
            [("get_weather", {"city": "Zürich"}), ("get_time", {})],
        ),
        (
            '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}',  # unclosed, key order
            None,
            [("get_weather", {"city": "Oslo"})],
        ),
        ("The weather is fine.", "The weather is fine.", []),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, []),  # cut off
        ('<tool_call>\n{"arguments": {"city": "Rome"}}\n</tool_call>', None, []),  # no name
        ("<tool_call>\nnot json\n</tool_call>", None, []),
    ],
    "llama3": [
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}; '
            '{"name": "get_time", "parameters": {}}',
            None,
            [("get_weather", {"city": "Lima", "days": 2}), ("get_time", {})],
        ),
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        ('{"city": "Paris"}', None, []),  # JSON, but not a call
        ('{"name": "get_weather", "parameters": {"city": ', None, []),
    ],
    "mistral": [
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {}}]',
            None,
            [("get_weather", {"city": "Paris"}), ("get_time", {})],
        ),
        (
            'Sure. [TOOL_CALLS] {"name": "get_time", "arguments": {"tz": "UTC"}}',
            "Sure. ",
            [("get_time", {"tz": "UTC"})],
        ),
        ("No tools needed.", "No tools needed.", []),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}', None, []),
        ("[TOOL_CALLS] nonsense", None, []),
    ],
}
CASES = [(name, *case) for name, cases in RECORDED.items() for case in cases]


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_output(parser: str, text: str, content: str | None, calls: list) -> None:
    parsed = TOOL_PARSERS[parser]().parse(text)
    assert calls_of(parsed) == calls
    if calls:
        assert parsed.content == content
        assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed.tool_calls)
    else:  # no call (or a malformed one): the text comes back as content, never an error
        assert parsed.content == text


def test_a_hermes_call_cut_off_after_whole_ones_is_dropped() -> None:
    """An output that ran out of tokens in its second call keeps the first (a model repeating its
    call under tool_choice=required with a small max_tokens); a cut-off first call keeps the text."""
    whole = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    parsed = TOOL_PARSERS["hermes"]().parse(whole + '<tool_call>\n{"name": "get_weather", "argu')
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})] and parsed.content is None
    malformed = whole + '<tool_call>\n{"name": "get_time", "argu\n</tool_call>'  # closed: not cut off
    assert TOOL_PARSERS["hermes"]().parse(malformed).tool_calls == []


def stream(parser: ToolParser, text: str, step: int) -> tuple[str, list[tuple[str, str]], int]:
    """Feed ``text`` ``step`` characters at a time: (content, [(name, arguments)], argument pieces)."""
    s = ToolCallStream(parser)
    content, calls, pieces = "", {}, 0
    parts = [s.feed(text[i : i + step]) for i in range(0, len(text), step)] + [s.finish()]
    for more, deltas in parts:
        content += more
        for d in deltas:
            name, args = calls.get(d.index, ("", ""))
            calls[d.index] = (d.name or name, args + d.arguments)
            pieces += bool(d.arguments)
            assert (d.id is not None) == (d.index not in calls or d.name is not None)
    return content, [calls[i] for i in sorted(calls)], pieces


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [c for c in CASES if c[3]])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streamed_pieces_concatenate_to_the_whole_parse(parser, text, content, calls, step) -> None:
    p = TOOL_PARSERS[parser]()
    whole = p.parse(text)
    streamed_content, streamed_calls, pieces = stream(p, text, step)
    assert (streamed_content or None) == whole.content
    assert streamed_calls == [(c.name, c.arguments) for c in whole.tool_calls]
    if step == 1:
        assert pieces > len(whole.tool_calls)  # arguments arrive in several pieces, not at the end


@pytest.mark.parametrize(("parser", "text"), [(c[0], c[1]) for c in CASES if not c[3]])
def test_streamed_text_without_calls_is_all_content(parser, text) -> None:
    content, calls, _ = stream(TOOL_PARSERS[parser](), text, 3)
    if not calls:  # a cut-off call may have sent its name already; then no content is invented
        assert content == text


def test_a_marker_split_across_pieces_is_held_back() -> None:
    s = ToolCallStream(TOOL_PARSERS["hermes"]())
    assert s.feed("Checking <tool") == ("Checking ", [])
    content, deltas = s.feed('_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert content == "" and deltas[0].name == "get_time" and deltas[0].id.startswith("call_")


def test_parallel_off_keeps_the_first_call() -> None:
    text = RECORDED["hermes"][1][0]
    content, calls, _ = "", {}, 0
    s = ToolCallStream(TOOL_PARSERS["hermes"](), limit=1)
    for part in (s.feed(text), s.finish()):
        content += part[0]
        for d in part[1]:
            calls.setdefault(d.index, "")
            calls[d.index] += d.arguments
    assert list(calls) == [0]


def accepts(constraint, text: str) -> bool:
    matcher = __import__("xgrammar").GrammarMatcher(
        xgrammar_compiler().compile_structural_tag(constraint.text)
    )
    return matcher.accept_string(text) and matcher.accept_token(2) and matcher.is_terminated()


CANONICAL = {
    "hermes": '<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>',
    "llama3": '{{"name": "{n}", "parameters": {a}}}',
    "mistral": '[TOOL_CALLS][{{"name": "{n}", "arguments": {a}}}]',
}


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
def test_forced_call_grammars_accept_their_format_and_round_trip(parser) -> None:
    p = TOOL_PARSERS[parser]()
    call = CANONICAL[parser].format(n="get_weather", a='{"city": "Paris", "days": 2}')
    other = CANONICAL[parser].format(n="get_time", a="{}")
    named = p.constraint(TOOLS, "get_weather", parallel=True)
    assert accepts(named, call)
    assert not accepts(named, other)
    assert not accepts(named, CANONICAL[parser].format(n="get_weather", a='{"days": 2}'))  # city required
    required = p.constraint(TOOLS, None, parallel=False)
    assert accepts(required, call) and accepts(required, other)
    assert not accepts(required, "I will not call a tool.")
    assert calls_of(p.parse(call)) == [("get_weather", {"city": "Paris", "days": 2})]
    hf_tokenizer()  # the compiler's tokenizer is the model's


def test_parallel_required_grammar_takes_several_calls() -> None:
    p = TOOL_PARSERS["hermes"]()
    one = CANONICAL["hermes"].format(n="get_time", a="{}")
    assert accepts(p.constraint(TOOLS, None, parallel=True), one + "\n" + one)
    assert not accepts(p.constraint(TOOLS, None, parallel=False), one + "\n" + one)
