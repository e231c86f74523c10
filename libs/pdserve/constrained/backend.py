"""``GrammarBackend``: compiles grammar specs with xgrammar on a worker thread, cached by spec.

xgrammar (Dong et al., 2024, "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models"; SGLang's and vLLM's default backend) compiles a grammar against the
vocabulary once: it precomputes which tokens each grammar position allows, so a matcher fills a
request's token bitmask in microseconds per step. Compiling takes milliseconds to seconds (a large
JSON Schema), which is why it never runs on the scheduler loop: ``compile`` returns a future.
xgrammar releases the GIL while it compiles, so the loop keeps scheduling meanwhile.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pdserve.constrained.grammar import Grammar
from pdserve.constrained.spec import GrammarSpec

logger = logging.getLogger(__name__)

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and may carry a failed check.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message names the kind and xgrammar's reason."""


class GrammarBackend:
    """Compiled grammars of one scheduler, keyed by ``GrammarSpec`` (LRU of at most ``cache_size``
    entries and ``cache_bytes`` of compiled grammars: one large regex compiles to over 100 MB).

    Args:
        load_tokenizer: returns the model's Hugging Face tokenizer; called once, on the worker
            thread, before the first compile (so a scheduler that never sees a grammar never pays
            for the vocabulary analysis, ~1-2 s for a 49k vocabulary on one core).
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary).
        stop_token_ids: the model's EOS token ids: the tokens that end a complete grammar.
        cache_size: compiled grammars (and compile failures) kept.
        cache_bytes: bytes of compiled grammars kept (xgrammar's ``memory_size_bytes``); the most
            recent one stays even if larger.

    ``compile`` is meant to be called from one thread (the scheduler loop's).
    """

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: list[int],
        cache_size: int = 256,
        cache_bytes: int = 512 << 20,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._started: dict[GrammarSpec, float] = {}  # when each cached spec's compile began (monotonic)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler = None

    def compile(self, spec: GrammarSpec) -> tuple[Future, bool]:
        """Start compiling ``spec`` (or reuse its cached compile).

        Returns:
            ``(future, hit)``: the future resolves to an opaque compiled grammar for ``matcher`` or
            raises ``GrammarError``; ``hit`` tells whether it came from the cache (it may still be
            compiling for an earlier request).
        """
        future = self._cache.get(spec)
        if future is not None and not future.cancelled():
            self._cache.move_to_end(spec)
            return future, True
        future = self._executor.submit(self._compile, spec)
        self._cache[spec] = future
        while len(self._cache) > 1 and (
            len(self._cache) > self.cache_size or self._bytes() > self.cache_bytes
        ):
            evicted, _ = self._cache.popitem(last=False)
            self._started.pop(evicted, None)
        return future, False

    def compile_started(self, spec: GrammarSpec) -> float | None:
        """When ``spec``'s compile began (``time.monotonic()``), or None while it waits for the worker."""
        return self._started.get(spec)

    def _bytes(self) -> int:
        """Bytes of the compiled grammars in the cache (compiles still running or failed count 0)."""
        done = (f for f in self._cache.values() if f.done() and not f.cancelled() and f.exception() is None)
        return sum(f.result().memory_size_bytes for f in done)

    def matcher(self, compiled: Any) -> Grammar:
        """A fresh matcher (at the grammar's start) over a grammar ``compile`` produced."""
        import xgrammar as xgr

        return Grammar(xgr.GrammarMatcher(compiled))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> Any:
        if spec in self._cache:  # (not evicted while it waited for the worker)
            self._started[spec] = time.monotonic()
        compiler = self._get_compiler()
        start = time.perf_counter()
        try:
            compiled = _compile_with(compiler, spec)
        except _XGRAMMAR_ERRORS as e:
            raise GrammarError(_bad_part(compiler, spec) or f"invalid {spec.kind}: {_reason(e)}") from None
        if not _allows_a_first_token(compiled, self.vocab_size):  # e.g. regex [^\s\S], ebnf root ::= root
            raise GrammarError(f"invalid {spec.kind}: it matches no text (no token may start it)")
        logger.debug("compiled a %s in %.3f s", spec.kind, time.perf_counter() - start)
        return compiled

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


_XGRAMMAR_ERRORS = (RuntimeError, ValueError, TypeError)  # how xgrammar reports bad input
# A structural tag's parts that are grammars of their own: their type, the key of their text, the kind.
_TAG_PARTS = {"json_schema": ("json_schema", "json_schema"), "regex": ("pattern", "regex"),
              "grammar": ("grammar", "ebnf")}  # fmt: skip


def _allows_a_first_token(compiled: Any, vocab_size: int) -> bool:
    """Whether a fresh matcher of ``compiled`` allows any token of ``[0, vocab_size)`` (a stop token
    counts): a grammar whose language is empty allows none, and a request under it could only fail."""
    import torch
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
    return bool(bits.flatten()[:vocab_size].any())


def _compile_with(compiler, spec: GrammarSpec) -> Any:
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.text, any_whitespace=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.text)
    return compiler.compile_structural_tag(spec.text)


def _bad_part(compiler, spec: GrammarSpec) -> str | None:
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
                _compile_with(compiler, GrammarSpec(kind, text))
            except _XGRAMMAR_ERRORS as e:
                return f"invalid {kind}: {_reason(e)}"
        else:
            todo.extend(node.values())
    return None


def _reason(error: Exception) -> str:
    """xgrammar's message without its C++ source location, on one line."""
    text = str(error).strip()
    lines = [_CPP_PREFIX.sub("", line).strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines)[:500] or type(error).__name__
