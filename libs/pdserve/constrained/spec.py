"""``GrammarSpec``: what a request holds its output to, as text the grammar backend compiles."""

from __future__ import annotations

from dataclasses import dataclass

# The sampling-parameter names of the grammar kinds (SGLang's names), in the order they are checked.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One grammar: ``kind`` (one of ``GRAMMAR_KINDS``) and its ``text``.

    - ``json_schema``: a JSON Schema (JSON text); the output is one JSON value valid under it,
      in one fixed layout (``", "`` and ``": "`` between items, no free whitespace, so small
      models cannot loop on blanks).
    - ``regex``: the whole output matches this regular expression (ECMAScript-like syntax).
    - ``ebnf``: an EBNF grammar in xgrammar's (GBNF-like) syntax whose start rule is ``root``.
    - ``structural_tag``: an xgrammar structural tag (JSON text), e.g. free text with tool calls
      held to their schemas, or a reasoning block followed by a JSON answer.

    Equal specs compile to the same grammar, so the spec itself is the cache key.
    """

    kind: str
    text: str
