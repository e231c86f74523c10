"""``GrammarBackend``: compiles grammar specs with xgrammar on a worker thread, cached by spec.

xgrammar (Dong et al., 2024, "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models"; SGLang's and vLLM's default backend) compiles a grammar against the
vocabulary once: it precomputes which tokens each grammar position allows, so a matcher fills a
request's token bitmask in microseconds per step. Compiling takes milliseconds to seconds (a large
JSON Schema), which is why it never runs on the scheduler loop: ``compile`` returns a future.
xgrammar releases the GIL while it compiles, so the loop keeps scheduling meanwhile. A grammar
new to the cache compiles first in the ``GrammarProbe``'s child process, which is killed when the
compile runs past its time or memory bound; only then does it compile in this process.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pdserve.constrained.compile import CompilerUnavailable, compile_spec
from pdserve.constrained.grammar import Grammar
from pdserve.constrained.probe import GrammarProbe
from pdserve.constrained.spec import GrammarSpec

logger = logging.getLogger(__name__)


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
        compile_timeout: seconds a grammar's compile may run in the probe before it is killed and the
            grammar fails (``GrammarError``: "grammar compilation took longer than ...").
        compile_memory_bytes: bytes of address space one compile may take in the probe.

    ``compile`` is meant to be called from one thread (the scheduler loop's).
    """

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: list[int],
        cache_size: int = 256,
        cache_bytes: int = 512 << 20,
        compile_timeout: float = 20.0,
        compile_memory_bytes: int = 1 << 30,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.compile_timeout = compile_timeout
        self.compile_memory_bytes = compile_memory_bytes
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._started: dict[GrammarSpec, float] = {}  # when each cached spec's compile began (monotonic)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler = None
        self._probe: GrammarProbe | None = None

    def compile(self, spec: GrammarSpec) -> tuple[Future, bool]:
        """Start compiling ``spec`` (or reuse its cached compile).

        Returns:
            ``(future, hit)``: the future resolves to an opaque compiled grammar for ``matcher`` or
            raises ``GrammarError`` (cached like a result) or ``CompilerUnavailable`` (not cached:
            the next call compiles again); ``hit`` tells whether it came from the cache (it may
            still be compiling for an earlier request).
        """
        future = self._cache.get(spec)
        if future is not None and not future.cancelled() and not _killed(future):
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
        """Cancel the compiles not started and kill the probe (a compile in progress fails)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._probe is not None:
            self._probe.close()

    def _compile(self, spec: GrammarSpec) -> Any:
        compiler = self._get_compiler()
        self._probe.start()
        if spec in self._cache:  # (not evicted while it waited for the worker)
            self._started[spec] = time.monotonic()
        start = time.perf_counter()
        self._probe.check(spec)
        probed = time.perf_counter()
        compiled = compile_spec(compiler, spec)
        logger.debug(
            "compiled a %s in %.3f s (%.3f s in the probe)",
            spec.kind,
            time.perf_counter() - start,
            probed - start,
        )
        return compiled

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._probe = GrammarProbe(
                info.serialize_json(), self.vocab_size, self.compile_timeout, self.compile_memory_bytes
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def _killed(future: Future) -> bool:
    """Whether ``future``'s compile ended with its compiler process killed from outside."""
    return future.done() and isinstance(future.exception(), CompilerUnavailable)
