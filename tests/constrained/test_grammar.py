"""The grammar backend on the real tokenizer: compile kinds, errors, cache, matchers and masks."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pdserve.constrained import GrammarSpec
from pdserve.constrained.backend import GrammarBackend
from pdserve.constrained.compile import CompilerUnavailable, GrammarError
from pdserve.constrained.grammar import apply_grammars
from pdserve.sampling.bounds import MAX_SCHEDULER_GRAMMAR_CHARS, BoundError
from pdserve.sampling.sampling_params import SamplingParams
from tests.reference import hf_tokenizer

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    backend = GrammarBackend(hf_tokenizer, VOCAB, [EOS])
    yield backend
    backend.close()


def compiled(backend: GrammarBackend, kind: str, text: str):
    return backend.compile(GrammarSpec(kind, text))[0].result(timeout=120)


def matcher_accepts(backend: GrammarBackend, kind: str, grammar: str, text: str) -> bool:
    """Whether ``text`` then EOS is a complete output of the grammar, token by token."""
    m = backend.matcher(compiled(backend, kind, grammar))
    return all(m.accept(t) for t in hf_tokenizer().encode(text)) and m.accept(EOS) and m.terminated


@pytest.mark.parametrize(
    ("kind", "grammar", "good", "bad"),
    [
        ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"], "additionalProperties": False}),
         '{"a": 12}', '{"a": "x"}'),
        ("regex", r"(yes|no), [0-9]{2}", "no, 42", "maybe, 42"),
        ("ebnf", 'root ::= "<" [a-c]+ ">"', "<abca>", "<abd>"),
        ("structural_tag", json.dumps({"type": "structural_tag", "format": {
            "type": "or", "elements": [{"type": "const_string", "value": "red"},
                                       {"type": "const_string", "value": "blue"}]}}), "blue", "green"),
    ],
)  # fmt: skip
def test_each_kind_accepts_its_language_only(backend, kind, grammar, good, bad):
    assert matcher_accepts(backend, kind, grammar, good)
    assert not matcher_accepts(backend, kind, grammar, bad)


def test_json_schema_is_compact_so_whitespace_cannot_loop(backend):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert matcher_accepts(backend, "json_schema", schema, '{"a": 1}')
    assert not matcher_accepts(backend, "json_schema", schema, '{ "a": 1}')
    assert not matcher_accepts(backend, "json_schema", schema, '{"a": 1}\n')


@pytest.mark.parametrize(
    ("kind", "text", "reason"),
    [
        ("json_schema", '{"type": "objec"}', 'Unsupported type "objec"'),
        ("json_schema", "not json", "Failed to parse JSON"),
        ("regex", "(ab", "parenthesis is not closed"),
        ("ebnf", 'root ::= "a" |', "EBNF parser error"),
        ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}', "nope"),
        ("regex", r"[^\s\S]", "matches no text"),  # grammars whose language is empty: no token could
        ("ebnf", "root ::= root", "matches no text"),  # be sampled under them
        ("ebnf", r"root ::= [^\x00-\U0010FFFF]", "matches no text"),
    ],
)
def test_bad_grammars_fail_with_a_clean_reason(backend, kind, text, reason):
    future, _ = backend.compile(GrammarSpec(kind, text))
    with pytest.raises(GrammarError) as err:
        future.result(timeout=120)
    message = str(err.value)
    assert message.startswith(f"invalid {kind}: ") and reason in message
    assert ".cc:" not in message and "Check failed" not in message and "\n" not in message


# (schema, a JSON text it forbids with the keyword xgrammar drops, where the refusal points)
UNENFORCED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "'uniqueItems' at #"),
    ({"not": {"type": "string"}}, '"abc"', "'not' at #"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, '"a"', "'if' at #"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "'dependentRequired' at #"),
    ({"allOf": [{"type": "string"}, {"minLength": 2}]}, '"a"', "'allOf' of more than one schema at #"),
    ({"type": "object", "properties": {"not": {"type": "number", "multipleOf": 0.5}}}, '{"not": 0.3}',
     "'multipleOf' other than an integer on type integer at #/properties/not"),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "breaks_it", "reason"), UNENFORCED)
def test_a_json_schema_keyword_xgrammar_would_drop_is_refused(backend, schema, breaks_it, reason):
    """xgrammar compiles these keywords as if they were absent (the text that breaks the schema is
    accepted by its grammar), so the schema is refused, naming the keyword and where it is."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), breaks_it)
    future, _ = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    with pytest.raises(GrammarError) as err:
        future.result(timeout=120)
    assert str(err.value) == f"invalid json_schema: {reason} is not supported (the output could break it)"


def test_keywords_xgrammar_enforces_and_annotations_compile(backend):
    schema = {
        "type": "object", "title": "t", "description": "d", "$comment": "c",
        "properties": {"n": {"type": "integer", "multipleOf": 3, "examples": [3]},
                       "tags": {"type": "array", "uniqueItems": False, "items": {"enum": ["a", "not"]}},
                       "if": {"allOf": [{"type": "string", "maxLength": 3}]}},
        "required": ["n", "tags", "if"], "additionalProperties": False,
    }  # fmt: skip
    text = json.dumps(schema)
    assert matcher_accepts(backend, "json_schema", text, '{"n": 6, "tags": ["a"], "if": "abc"}')
    assert not matcher_accepts(backend, "json_schema", text, '{"n": 4, "tags": ["a"], "if": "abc"}')


@pytest.mark.parametrize(
    ("part", "kind", "reason"),
    [
        (
            {"type": "json_schema", "json_schema": {"type": "objec"}},
            "json_schema",
            'Unsupported type "objec"',
        ),
        ({"type": "regex", "pattern": "(ab"}, "regex", "parenthesis is not closed"),
        ({"type": "grammar", "grammar": 'root ::= "a" |'}, "ebnf", "EBNF parser error"),
    ],
)
def test_a_structural_tag_names_the_part_that_is_wrong(backend, part, kind, reason):
    """A reasoning block before the client's grammar: the error names the client's kind, not the tag."""
    free = {"type": "optional", "content": {"type": "tag", "begin": "<think>", "end": "</think>",
                                            "content": {"type": "any_text"}}}  # fmt: skip
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [free, part]}}
    future, _ = backend.compile(GrammarSpec("structural_tag", json.dumps(tag)))
    with pytest.raises(GrammarError) as err:
        future.result(timeout=120)
    assert str(err.value).startswith(f"invalid {kind}: ") and reason in str(err.value)


def test_compiles_are_cached_by_spec(backend):
    spec = GrammarSpec("regex", "[0-9]{3}-cache")
    first, hit = backend.compile(spec)
    assert not hit
    first.result(timeout=120)
    again, hit = backend.compile(GrammarSpec("regex", "[0-9]{3}-cache"))
    assert hit and again is first


def test_cache_is_bounded_lru():
    backend = GrammarBackend(hf_tokenizer, VOCAB, [EOS], cache_size=2)
    try:
        specs = [GrammarSpec("regex", f"a{i}") for i in range(3)]
        for spec in specs:
            backend.compile(spec)
        assert backend.compile(specs[0])[1] is False  # the oldest was evicted
        assert backend.compile(specs[2])[1] is True
    finally:
        backend.close()


def test_cache_is_bounded_in_bytes():
    """Compiled grammars count by their size too: with room for one, a compiled grammar is evicted
    by the next compile, and the most recent one stays even when larger than the bound."""
    backend = GrammarBackend(hf_tokenizer, VOCAB, [EOS], cache_bytes=1)
    try:
        first, second = GrammarSpec("regex", "b0-bytes"), GrammarSpec("regex", "b1-bytes")
        assert backend.compile(first)[0].result(timeout=120).memory_size_bytes > 1
        assert backend.compile(first)[1] is True  # alone in the cache: kept
        backend.compile(second)[0].result(timeout=120)
        backend.compile(GrammarSpec("regex", "b2-bytes"))
        assert backend.compile(second)[1] is False  # evicted once a later compile joined the cache
        assert backend.compile_started(first) is None  # its start time went with it
    finally:
        backend.close()


def probes() -> set:
    """The live grammar-probe children of this process."""
    return {p for p in multiprocessing.active_children() if p.name == "grammar-probe"}


def test_a_compile_past_the_timeout_is_killed_and_the_next_one_runs():
    """xgrammar cannot stop a compile midway: the probe's child running one is killed at the timeout
    and the grammar fails as too slow; the next grammar compiles in a fresh child. The child's start
    (~2 s) does not count: the first grammar compiles under a 0.5 s timeout."""
    before = probes()
    backend = GrammarBackend(hf_tokenizer, VOCAB, [EOS], compile_timeout=0.5)
    try:
        assert compiled(backend, "regex", "[0-9]+-first").memory_size_bytes > 0
        (first,) = probes() - before
        future, _ = backend.compile(GrammarSpec("regex", "(a|b)" * 6000))  # ~4 s on a 2-core Zen 4
        with pytest.raises(GrammarError, match=r"^grammar compilation took longer than 0.5 s$"):
            future.result(timeout=120)
        assert not first.is_alive()
        m = backend.matcher(compiled(backend, "regex", "[0-9]+-next"))
        assert all(m.accept(t) for t in hf_tokenizer().encode("42-next"))
        (second,) = probes() - before
        assert second is not first
    finally:
        backend.close()
    second.join(timeout=10)
    assert not second.is_alive()  # close() ended it


def test_a_compile_past_the_memory_bound_fails_and_the_probe_serves_on():
    """A compile that needs more address space than the bound (``(a|b)*8000`` compiles to 60 MB)
    fails its grammar with the bound named; the same child compiles the next grammar."""
    before = probes()
    backend = GrammarBackend(hf_tokenizer, VOCAB, [EOS], compile_memory_bytes=16 << 20)
    try:
        future, _ = backend.compile(GrammarSpec("regex", "(a|b)" * 8000))
        with pytest.raises(GrammarError, match=r"^invalid regex: compiling it needs more than 16 MiB$"):
            future.result(timeout=120)
        (probe,) = probes() - before
        assert compiled(backend, "regex", "[0-9]+-after").memory_size_bytes > 0
        assert probes() - before == {probe}
    finally:
        backend.close()


def test_a_probe_killed_from_outside_fails_the_compile_as_retryable_and_uncached():
    """SIGKILL of the probe mid-compile (the OOM killer, an operator) says nothing about the grammar:
    ``CompilerUnavailable`` (the servicers' 429), not cached, so the same grammar compiles next time."""
    before = probes()
    backend = GrammarBackend(hf_tokenizer, VOCAB, [EOS])
    try:
        compiled(backend, "regex", "[0-9]+-warm")
        (probe,) = probes() - before
        spec = GrammarSpec("regex", "(a|b)" * 4000)  # ~2 s on a 2-core Zen 4
        future, _ = backend.compile(spec)
        while backend.compile_started(spec) is None:
            time.sleep(0.01)
        os.kill(probe.pid, signal.SIGKILL)
        with pytest.raises(CompilerUnavailable, match=r"killed \(SIGKILL\) while compiling it; retry"):
            future.result(timeout=120)
        again, hit = backend.compile(spec)
        assert not hit and again.result(timeout=120).memory_size_bytes > 0
    finally:
        backend.close()


PROBE_ORPHAN = """
import multiprocessing, time
from pdserve.constrained import GrammarSpec
from pdserve.constrained.backend import GrammarBackend
from tests.reference import hf_tokenizer
backend = GrammarBackend(hf_tokenizer, 49152, [2])
backend.compile(GrammarSpec("regex", "[0-9]+"))[0].result(timeout=120)
(probe,) = multiprocessing.active_children()
backend.compile(GrammarSpec("regex", "(a|b)" * 8000))  # ~8 s of compile in the probe
print(probe.pid, flush=True)
time.sleep(120)
"""


def test_the_probe_dies_with_its_scheduler_mid_compile():
    """A scheduler killed by SIGKILL (the OOM killer) takes its probe with it at once, even in the
    middle of a compile: the kernel's parent-death signal, not the end of the compile."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PROBE_ORPHAN], cwd=Path(__file__).parents[2], stdout=subprocess.PIPE, text=True
    )
    try:
        probe_pid = int(proc.stdout.readline())
        time.sleep(0.5)
        assert process_state(probe_pid) not in (None, "Z")  # compiling
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5  # well before the compile could end
    while process_state(probe_pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_state(probe_pid) in (None, "Z")


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``Z``: a zombie, dead), None if it is gone (Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_compile_runs_off_the_calling_thread(monkeypatch):
    """compile() hands back a pending future at once; the compile runs on the grammar thread.

    The compile is held at a gate the test opens only after compile() returned, so a compile on
    the calling thread would hang here instead of passing by luck of timing.
    """
    backend = GrammarBackend(hf_tokenizer, VOCAB, [EOS])
    gate = threading.Event()
    ran_on: list[str] = []
    real_get_compiler = backend._get_compiler

    def gated_get_compiler():
        ran_on.append(threading.current_thread().name)
        assert gate.wait(timeout=60)
        return real_get_compiler()

    monkeypatch.setattr(backend, "_get_compiler", gated_get_compiler)
    try:
        future, hit = backend.compile(GrammarSpec("regex", "[a-z]{2}-gated"))
        assert not hit and not future.done()
        gate.set()
        m = backend.matcher(future.result(timeout=120))
        assert all(m.accept(t) for t in hf_tokenizer().encode("ab-gated"))
        assert ran_on and ran_on[0].startswith("grammar")
        assert threading.current_thread().name not in ran_on
    finally:
        backend.close()


def test_a_refused_token_is_remembered(backend):
    m = backend.matcher(compiled(backend, "regex", "ab"))
    a, b = hf_tokenizer().encode("a")[0], hf_tokenizer().encode("b")[0]
    assert not m.accept(b)
    assert m.rejected == b
    assert not m.accept(a)  # once refused, the matcher stays refused
    assert m.rejected == b


def test_an_ended_grammar_masks_nothing(backend):
    """A finished request may still be in a batch an overlapped loop built: its row stays unmasked."""
    m = backend.matcher(compiled(backend, "regex", "a"))
    assert m.accept(hf_tokenizer().encode("a")[0]) and m.accept(EOS) and m.terminated
    logits = torch.zeros(1, VOCAB)
    apply_grammars(logits, [m])
    assert torch.isfinite(logits).all()


def test_masks_only_constrained_rows(backend):
    m = backend.matcher(compiled(backend, "regex", "(yes|no)"))
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    rows = apply_grammars(logits, [None, m, None])
    assert rows == [1]
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    allowed = torch.isfinite(logits[1]).nonzero().squeeze(1).tolist()
    texts = [hf_tokenizer().decode([t]) for t in allowed]
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert EOS not in allowed  # the grammar is not complete yet


def test_spec_and_sampling_params_bounds():
    for params, field, message in (
        (SamplingParams(regex="a" * (MAX_SCHEDULER_GRAMMAR_CHARS + 1)), "regex", "at most 262144"),
        (SamplingParams(regex="a", ebnf='root ::= "a"'), "ebnf", "cannot be combined with regex"),
        (SamplingParams(regex="a", ignore_eos=True), "ignore_eos", "cannot be combined with regex"),
        (SamplingParams(regex=""), "regex", "must not be empty"),
    ):
        with pytest.raises(BoundError, match=message) as info:
            params.validate()
        assert info.value.field == field
    SamplingParams(regex="a" * MAX_SCHEDULER_GRAMMAR_CHARS).validate()
    assert SamplingParams(json_schema="{}").grammar == GrammarSpec("json_schema", "{}")
