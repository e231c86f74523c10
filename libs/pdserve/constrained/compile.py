"""Compiling one ``GrammarSpec`` with xgrammar, and the checks that make a failure a clean reason.

Used in two processes: the grammar probe's child compiles every new spec first, with all checks
(``compile_checked``); the scheduler's process compiles only specs the probe passed (``compile_spec``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdserve.constrained.spec import GrammarSpec

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and may carry a failed check.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
XGRAMMAR_ERRORS = (RuntimeError, ValueError, TypeError)  # how xgrammar reports bad input
# A structural tag's parts that are grammars of their own: their type, the key of their text, the kind.
_TAG_PARTS = {"json_schema": ("json_schema", "json_schema"), "regex": ("pattern", "regex"),
              "grammar": ("grammar", "ebnf")}  # fmt: skip


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message names the kind and the reason."""


class CompilerUnavailable(RuntimeError):
    """The compiler process was killed from outside (SIGKILL or SIGTERM: the OOM killer, an operator,
    the service stopping) while it compiled a grammar: nothing is known about the grammar, and a
    retry may succeed."""


def too_slow(timeout_s: float) -> str:
    """The reason of a grammar whose own compile ran past ``timeout_s`` seconds."""
    return f"grammar compilation took longer than {timeout_s:g} s"


def compile_checked(compiler: Any, spec: GrammarSpec, vocab_size: int) -> Any:
    """Compile ``spec`` with an ``xgr.GrammarCompiler`` and check that a token may start it.

    Returns:
        the ``xgr.CompiledGrammar``.

    Raises:
        GrammarError: a JSON Schema uses a keyword xgrammar would not enforce
            (``unenforced_keyword``), xgrammar refused it (for a structural tag, named after the
            client's failing part), or its language is empty (regex ``[^\\s\\S]``, ebnf
            ``root ::= root``): a request under it could only fail at its first token.
        MemoryError: xgrammar ran out of memory (``std::bad_alloc``).
    """
    if spec.kind == "json_schema":
        _refuse_unenforced(spec.text)
    try:
        compiled = compile_spec(compiler, spec)
    except XGRAMMAR_ERRORS as e:
        if "bad_alloc" in str(e):
            raise MemoryError(str(e)) from None
        raise GrammarError(_bad_part(compiler, spec) or f"invalid {spec.kind}: {_reason(e)}") from None
    if not _allows_a_first_token(compiled, vocab_size):
        raise GrammarError(f"invalid {spec.kind}: it matches no text (no token may start it)")
    return compiled


# Subschemas under a keyword: a map of them, one, or a list of them (JSON Schema 2020-12 and draft 7).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalItems", "additionalProperties", "unevaluatedItems",
                  "unevaluatedProperties", "contains", "propertyNames")  # fmt: skip
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
# Keywords xgrammar 0.2.9 compiles as if they were absent (checked by the strings it then accepts).
_UNENFORCED = ("not", "if", "dependentRequired", "dependentSchemas", "dependencies")


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of JSON Schema ``schema`` that xgrammar would silently not enforce, with
    where it is (e.g. ``'uniqueItems' at #/properties/tags``); None when every keyword is enforced
    or is an annotation (``title``, ``description``, ...).

    Not enforced: ``not``, ``if``/``then``/``else``, ``dependentRequired``, ``dependentSchemas``,
    ``dependencies``, ``uniqueItems: true``, ``allOf`` of more than one subschema, and
    ``multipleOf`` except an integer one on ``type: integer``. A grammar that drops them would let
    the output break the schema the client asked for, so such a schema is refused (as OpenAI's
    strict mode refuses keywords it does not support, and vLLM refuses them for xgrammar).
    """
    todo: list[tuple[Any, str]] = [(schema, "#")]
    while todo:
        node, path = todo.pop()
        if not isinstance(node, dict):
            continue
        if found := _unenforced_in(node):
            return f"{found} at {path}"
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                todo += [(sub, f"{path}/{key}/{name}") for name, sub in node[key].items()]
        todo += [(node[key], f"{path}/{key}") for key in _SCHEMA_VALUES if key in node]
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                todo += [(sub, f"{path}/{key}/{i}") for i, sub in enumerate(node[key])]
    return None


def _unenforced_in(node: dict) -> str | None:
    """The first keyword of the schema object ``node`` itself (not its subschemas) xgrammar drops."""
    if keyword := next((k for k in _UNENFORCED if k in node), None):
        return f"'{keyword}'"
    if node.get("uniqueItems") is True:
        return "'uniqueItems'"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' of more than one schema"
    if "multipleOf" in node and not _integer_multiple(node):
        return "'multipleOf' other than an integer on type integer"
    return None


def _refuse_unenforced(text: str) -> None:
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        return  # not JSON: xgrammar's error names the problem
    if keyword := unenforced_keyword(schema):
        raise GrammarError(f"invalid json_schema: {keyword} is not supported (the output could break it)")


def _integer_multiple(node: dict) -> bool:
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    step = node["multipleOf"]
    integral = isinstance(step, int) and not isinstance(step, bool)
    return integral and "integer" in types and "number" not in types


def compile_spec(compiler: Any, spec: GrammarSpec) -> Any:
    """``spec`` compiled by ``compiler`` (an ``xgr.CompiledGrammar``); raises xgrammar's own errors."""
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.text, any_whitespace=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.text)
    return compiler.compile_structural_tag(spec.text)


def _allows_a_first_token(compiled: Any, vocab_size: int) -> bool:
    """Whether a fresh matcher of ``compiled`` allows any token of ``[0, vocab_size)`` (a stop token
    counts). Plain Python on the 32-bit words: no torch op (its OpenMP team would start threads in
    the probe's bounded address space)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    words = bitmask[0].tolist()  # bit t % 32 of word t // 32 set when token t is allowed
    full, rest = divmod(vocab_size, 32)
    return any(words[:full]) or (rest > 0 and words[full] & ((1 << rest) - 1) != 0)


def _bad_part(compiler: Any, spec: GrammarSpec) -> str | None:
    """Why a structural tag failed, named after the first of its JSON Schema / regex / EBNF parts
    that fails alone (the part a client sent: a reasoning or tool-call wrapper around it is the
    gateway's), e.g. ``invalid json_schema: Unsupported type "objec"``; None when none does."""
    if spec.kind != "structural_tag":
        return None
    try:
        todo = [json.loads(spec.text)]
    except ValueError:
        return None
    while todo:
        node = todo.pop(0)
        if isinstance(node, list):
            todo.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        key, kind = _TAG_PARTS.get(node.get("type"), (None, None))
        if kind is not None and key in node:
            text = node[key] if isinstance(node[key], str) else json.dumps(node[key])
            try:
                compile_spec(compiler, GrammarSpec(kind, text))
            except XGRAMMAR_ERRORS as e:
                return f"invalid {kind}: {_reason(e)}"
        else:
            todo.extend(node.values())
    return None


def _reason(error: Exception) -> str:
    """xgrammar's message without its C++ source location, on one line."""
    text = str(error).strip()
    lines = [_CPP_PREFIX.sub("", line).strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines)[:500] or type(error).__name__
