"""The grammar queue: constrained requests wait here while their grammar compiles off the loop.

SGLang keeps such requests in a ``grammar_queue`` and moves each to the waiting queue once its
grammar is ready; a compile that fails or takes too long fails the request. The compile runs on
the ``GrammarBackend``'s worker thread; the scheduler polls this queue at the start of each step.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from pdserve.constrained.backend import GrammarBackend
from pdserve.constrained.compile import CompilerUnavailable, too_slow
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.req import Req


class GrammarQueue:
    """Requests whose grammar is compiling, by rid.

    Args:
        backend: compiles grammars; None where this scheduler constrains nothing (``add`` refuses).
        timeout_s: seconds a request may wait for its grammar before it fails.
        metrics: counts grammar cache hits and misses.
    """

    def __init__(self, backend: GrammarBackend | None, timeout_s: float, metrics: SchedulerMetrics) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._pending: dict[str, tuple[Req, Future, float]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, req: Req) -> None:
        """Start compiling ``req``'s grammar (or reuse the cached one) and hold ``req`` meanwhile.

        Raises:
            ValueError: this scheduler has no grammar backend.
        """
        if self.backend is None:
            raise ValueError("this scheduler has no grammar backend: constrained decoding is unavailable")
        future, hit = self.backend.compile(req.sampling_params.grammar)
        self.metrics.grammar_requests.labels(cache="hit" if hit else "miss").inc()
        self._pending[req.rid] = (req, future, time.monotonic())

    def future(self, rid: str) -> Future | None:
        """The compile ``rid`` waits for (resolves to a compiled grammar or raises ``GrammarError``)."""
        entry = self._pending.get(rid)
        return entry[1] if entry else None

    def remove(self, req: Req) -> None:
        self._pending.pop(req.rid, None)

    def close(self) -> None:
        """Stop the backend's compiles (its probe process ends); for a scheduler that stops serving."""
        if self.backend is not None:
            self.backend.close()

    def pop_done(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """Take out the requests whose wait is over.

        Returns:
            ``(ready, failed)``: ready requests carry a ``Grammar`` in ``req.grammar``, advanced by
            the tokens they already generated (a request retracted on a decode worker and prefilled
            again here); failed ones come with the reason (the compile error, the timeout, or a
            generated token the grammar refuses), both in arrival order.
        """
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        now = time.monotonic()
        for rid, (req, future, start) in list(self._pending.items()):
            if future.done():
                del self._pending[rid]
                try:
                    req.grammar = self.backend.matcher(future.result())
                except Exception as e:  # GrammarError, CompilerUnavailable, the compile thread's own failure
                    req.retryable = isinstance(e, CompilerUnavailable)
                    failed.append((req, str(e) or type(e).__name__))
                    continue
                if all(req.grammar.accept(token) for token in req.output_ids):
                    ready.append(req)
                else:
                    failed.append(
                        (req, f"generated token {req.grammar.rejected} is not allowed by the grammar")
                    )
            elif now - start > self.timeout_s:
                del self._pending[rid]
                reason, req.retryable = self.timeout_reason(req)
                failed.append((req, reason))
        return ready, failed

    def timeout_reason(self, req: Req) -> tuple[str, bool]:
        """Why ``req``'s wait for its grammar ran out, and whether the client may retry: its own compile
        ran past ``timeout_s`` (a grammar too costly to compile: not retryable, a 400), or it waited
        behind other requests' compiles on the one worker (the compiler is busy: retryable)."""
        started = self.backend.compile_started(req.sampling_params.grammar)
        if started is not None and time.monotonic() - started >= self.timeout_s:
            return too_slow(self.timeout_s), False
        return (
            f"the grammar compiler is busy: this request's grammar waited {self.timeout_s:g} s behind "
            "other requests' grammars; retry later",
            True,
        )
