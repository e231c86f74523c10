"""This replica's in-flight requests (rid -> state), which the detokenizers' outputs are pushed into.

A client request is one ``RequestHandle`` with one ``ReqState`` per choice (sub-request, its own
rid). The ``GatewayOutputServicer`` (``transport.output_servicer``) looks each incoming output up by
rid in the ``RequestRegistry`` and pushes it into the owning handle's queue; outputs for rids this
replica no longer holds (aborted, timed out) are dropped. A choice leaves the registry, and its
route is released, on its last output or on close.

Prompt logprobs are computed once per prompt, not once per sample: with ``n > 1`` only sample 0 of a
prompt asks for them (its ``ReqState.samples`` are the others, sent without, so they hit the radix
cache its prompt KV enters), and each other sample's outputs are held until sample 0's outputs have
brought them, then carry a copy on their first piece (``RequestHandle.push``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pdserve.services.gateway.errors import GatewayError, duplicate_rid, generation_failed
from pdserve.services.gateway.io_struct import ChoiceDelta, FinishReason, SamplingParams, TokenLogprob
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.routing.router import Route


@dataclass(slots=True, eq=False)
class ReqState:
    """One choice of a request: what was sent, where, and its token timing."""

    rid: str
    index: int
    input_ids: list[int]
    sampling_params: SamplingParams
    owner: RequestHandle
    route: Route | None = None
    output_address: str = ""  # the detokenizer that turns its tokens into text
    sent: bool = False
    sending: asyncio.Future | None = None  # its DecodeScheduler.Generate call while that is in flight
    finished: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None
    # the output ids pushed to its client so far (a migration resumes from them), and how many times
    # it moved to another decode worker (``migration``)
    output_ids: list[int] = field(default_factory=list)
    migrations: int = 0
    # prompt logprobs with n > 1 (see the module docstring): on sample 0, the prompt's other samples
    # and, once its outputs brought them, the scores they copy; on another sample, sample 0 and the
    # outputs held until its scores came
    samples: list[ReqState] = field(default_factory=list)
    scores: list[TokenLogprob] | None = None
    scorer: ReqState | None = None
    held: list[ChoiceDelta] | None = None


class RequestRegistry:
    """rid -> ``ReqState`` for every choice this replica has in flight."""

    def __init__(self) -> None:
        self._states: dict[str, ReqState] = {}

    def get(self, rid: str) -> ReqState | None:
        return self._states.get(rid)

    def add(self, state: ReqState) -> None:
        """Raises ``GatewayError`` 409 when ``state.rid`` is already in flight."""
        if state.rid in self._states:
            raise duplicate_rid(state.rid)
        self._states[state.rid] = state

    def remove(self, rid: str) -> None:
        self._states.pop(rid, None)

    def rename(self, state: ReqState, rid: str) -> None:
        """``state`` goes on as ``rid`` (a migrated choice's continuation): outputs of its old rid are
        dropped from now on. Raises ``GatewayError`` 409 when ``rid`` is already in flight."""
        if rid in self._states:
            raise duplicate_rid(rid)
        self._states.pop(state.rid, None)
        self._states[rid] = state
        state.rid = rid


@dataclass(eq=False)
class RequestHandle:
    """The outputs of one client request, merged over its choices in arrival order.

    Iterate it for ``ChoiceDelta`` pieces until every choice has finished; use it as an async
    context manager (or call ``close``) so that choices still running are aborted when the consumer
    stops early (client gone, cancelled, timed out).

    Args:
        rid: the client-visible request id.
        owner: the API key it was sent with (None without API keys).
        registry: where its choices are registered.
        metrics: TTFT / ITL / e2e histograms.
        abort_backend: called with each choice that was sent but not finished when closing.
        on_close: called once when the handle closes.
        migrate: called with a choice whose decode worker went away (its output stream ended) and
            the reason; True when it continues on another worker (``migration``), else it ends.
        deadline: ``time.monotonic()`` after which iteration raises ``GatewayError`` 504; None = none.
    """

    rid: str
    owner: str | None
    registry: RequestRegistry
    metrics: GatewayMetrics
    abort_backend: Callable[[ReqState, str], None]
    on_close: Callable[[RequestHandle], None]
    migrate: Callable[[ReqState, str], bool] | None = None
    deadline: float | None = None
    states: list[ReqState] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)  # per prompt
    arrival: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue[ChoiceDelta | None] = field(default_factory=asyncio.Queue)
    closed: bool = False
    close_reason: str = ""
    first_delta: ChoiceDelta | None = None
    abort_reason: str = ""  # set when the whole request was aborted (``abort`` of every choice)
    _pending_finishes: int = 0
    _answered: asyncio.Event = field(default_factory=asyncio.Event)  # first output, or closed

    @property
    def completed(self) -> bool:
        """It had choices, and every choice's finish was read by the consumer."""
        return bool(self.states) and self._pending_finishes == 0

    def add_choice(self, state: ReqState) -> None:
        self.registry.add(state)
        self.states.append(state)
        self._pending_finishes += 1

    def push(self, state: ReqState, delta: ChoiceDelta) -> None:
        """Deliver one output of ``state`` (called by the output servicer and by ``abort``)."""
        if state.finished:
            return
        state.output_ids.extend(delta.token_ids)
        if delta.worker_lost and self.migrate is not None and self.migrate(state, "stream_ended"):
            return
        now = time.monotonic()
        if delta.token_ids:
            if state.first_token_at is None:
                state.first_token_at = now
                self.metrics.ttft.observe(now - self.arrival)
            elif state.last_token_at is not None:
                gap = (now - state.last_token_at) / len(delta.token_ids)
                for _ in delta.token_ids:
                    self.metrics.itl.observe(gap)
            state.last_token_at = now
        delta.prompt_tokens = len(state.input_ids)
        if delta.finish_reason is not None:
            self._finish(state)
        scorer = state.scorer
        if scorer is not None and state.held is not None:  # waiting for sample 0's prompt logprobs
            state.held.append(delta)
            if scorer.scores is not None:
                self._release(state, scorer.scores)
            return
        if state.samples and state.scores is None and (delta.prompt_logprobs or state.finished):
            state.scores = delta.prompt_logprobs  # sample 0's scores came (or it ended without)
            self._enqueue(delta)
            for sample in state.samples:
                self._release(sample, state.scores)
            return
        self._enqueue(delta)

    def _release(self, state: ReqState, scores: list[TokenLogprob]) -> None:
        """Deliver the outputs ``state`` held, its first piece with a copy of ``scores`` (none held
        yet: its first piece takes them as it comes)."""
        if not state.held:
            return
        held, state.held = state.held, None
        held[0].prompt_logprobs = list(scores)
        for delta in held:
            self._enqueue(delta)

    def _enqueue(self, delta: ChoiceDelta) -> None:
        if self.first_delta is None:
            self.first_delta = delta
            self._answered.set()
        self.queue.put_nowait(delta)

    def _finish(self, state: ReqState) -> None:
        state.finished = True
        self.registry.remove(state.rid)
        if state.route is not None:
            state.route.release()

    def abort(
        self,
        reason: str,
        states: list[ReqState] | None = None,
        finish_reason: FinishReason = "abort",
        retryable: bool = False,
    ) -> None:
        """End running choices (all, or ``states``) with ``finish_reason``; abort them in the backend.

        ``retryable``: an "error" the client may retry (a worker went down), answered 503.
        Aborting all of them also marks the request aborted (``abort_reason``), so that choices not
        sent yet never are.
        """
        if states is None:
            self.abort_reason = reason
        for state in self.states if states is None else states:
            if not state.finished:
                self._abort_sent(state, reason)
                end = ChoiceDelta(state.index, finish_reason=finish_reason, error=reason, retryable=retryable)
                self.push(state, end)

    def _abort_sent(self, state: ReqState, reason: str) -> None:
        """The gateway ends ``state``: abort it in its scheduler if sent, and stop waiting for the
        scheduler's answer to it if that is still in flight (a hung worker taken out must not hold
        its requests until the call's deadline). An end the scheduler itself sent (an output) leaves
        the call alone: its answer (e.g. INVALID_ARGUMENT for a bad grammar) is the request's."""
        if state.sent:
            self.abort_backend(state, reason)
        if state.sending is not None:
            state.sending.cancel()

    async def first_output(self) -> None:
        """Wait for the request's first output (a stream's HTTP status is decided by it).

        Raises:
            GatewayError: 504 when the deadline passes first; the 503 of a retryable failure (the
                server overloaded, a worker gone) when that is the first output, so the client gets a
                real 503 with ``Retry-After`` rather than a stream that fails.
        """
        try:
            async with asyncio.timeout(None if self.deadline is None else self.deadline - time.monotonic()):
                await self._answered.wait()
        except TimeoutError:
            raise GatewayError(504, f"request {self.rid} passed its deadline") from None
        first = self.first_delta
        if first is not None and first.finish_reason == "error" and first.retryable:
            raise generation_failed(first.error, retryable=True)

    async def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        while self._pending_finishes > 0:
            try:
                async with asyncio.timeout(
                    None if self.deadline is None else self.deadline - time.monotonic()
                ):
                    delta = await self.queue.get()
            except TimeoutError:
                raise GatewayError(504, f"request {self.rid} passed its deadline") from None
            if delta is None:
                raise GatewayError(499, f"request {self.rid} was closed: {self.close_reason}")
            if delta.finish_reason is not None:
                self._pending_finishes -= 1
            yield delta
        self.metrics.e2e.observe(time.monotonic() - self.arrival)

    def close(self, reason: str = "client gone") -> None:
        """Abort unfinished choices, unregister everything; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        for state in self.states:
            if not state.finished:
                self._abort_sent(state, reason)
                self._finish(state)
        self.on_close(self)
        self.queue.put_nowait(None)  # wakes a consumer still iterating
        self._answered.set()

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()
