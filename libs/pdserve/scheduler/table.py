"""The request table: every request a scheduler holds, by rid, from its checked entry to its end.

Entry (``add``) is the scheduler's firewall (its internal port is reachable too, not only through the
gateway): a request is checked here as the gateway checks it, before anything is queued, so that no
forward step ever sees a value that could fail the whole batch.

Exit (``end``) happens exactly once: the request leaves the waiting queue and the role's stages, and
its KV is released exactly once: at once; or, while a scheduled forward still reads it, when the
last such batch is processed; or, where a prefill worker may still be writing its pages, once they
drained (``RemotePrefill``). Then it is counted and ``on_request_end`` runs.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass

from pdserve.sampling.bounds import MAX_PROMPT_LOGPROB_TOKENS, MAX_SCHEDULER_RID_CHARS, BoundError
from pdserve.scheduler.kv_ledger import KVLedger
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.req import FinishReason, Req
from pdserve.scheduler.schedule_batch import StepOutput
from pdserve.scheduler.waiting import WaitingQueue


class DuplicateRid(ValueError):
    """A request whose rid the scheduler already holds (running, queued, or its KV still draining):
    nothing was queued, and the request holding the rid goes on."""


class UnknownAdapter(ValueError):
    """A request of a LoRA adapter this worker does not hold (unloaded while the request travelled
    from the gateway's model check): nothing was queued; NOT_FOUND, the gateway's 404
    ``model_not_found``."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model '{name}' does not exist.")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request must fit.

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)``.
        context_len: positions of the model's context.
        prompt_room: positions a prompt must leave free in the context (1 on a prefill worker, whose
            decode worker goes on from the token it samples).
        usable_pages / page_size: the KV pool, which must hold the prompt and its first token.
        pooling: the model's embedding pooling (``ModelConfig.pooling``; None: it serves no embeddings).
        adapters: the LoRA adapters served, by name (``LoraManager.adapters``, which run-time loads
            change; empty: none).
    """

    vocab_size: int
    context_len: int
    prompt_room: int
    usable_pages: int
    page_size: int
    pooling: str | None = "last"
    adapters: Container[str] = ()


class RequestTable(Mapping[str, Req]):
    """rid -> ``Req`` of every request queued or admitted and not ended.

    Args:
        limits: what a new request must fit.
        queue: where a new request waits.
        ledger: releases an ended request's KV.
        metrics: request counts and latencies.
        clock: the scheduler's clock.
        leave: takes a request out of the queue and the stages; True when a stage holds its pages on
            (the request ended while a prefill worker writes them).
        held: whether an ended request's rid is still held (its KV still draining): not reusable yet.
        counts_finishes: this worker owns the requests' finish (not a prefill worker, which hands them
            on): ``requests_finished`` counts them here.

    Attributes:
        on_request_end: called with every request as it ends (finish, abort, failure), after its
            pages are released.
    """

    def __init__(
        self,
        limits: RequestLimits,
        queue: WaitingQueue,
        ledger: KVLedger,
        metrics: SchedulerMetrics,
        clock: Callable[[], float],
        leave: Callable[[Req], bool],
        held: Callable[[str], bool],
        counts_finishes: bool,
    ) -> None:
        self.limits, self.queue, self.ledger, self.metrics, self.clock = limits, queue, ledger, metrics, clock
        self._leave, self._held, self.counts_finishes = leave, held, counts_finishes
        self._reqs: dict[str, Req] = {}
        self.aborted: list[StepOutput] = []  # ended outside a step's results, not reported yet
        self.on_request_end: Callable[[Req], None] | None = None

    def __getitem__(self, rid: str) -> Req:
        return self._reqs[rid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._reqs)

    def __len__(self) -> int:
        return len(self._reqs)

    # ---- entry --------------------------------------------------------------------------
    def add(self, req: Req) -> int:
        """Check ``req`` and queue it (a constrained one waits for its grammar first); returns its
        place in the waiting queue.

        Raises:
            QueueFull: the waiting queue (with the grammar queue) is at its bound.
            DuplicateRid: (a ValueError) the rid is held by another request.
            ValueError: an empty rid or one over ``MAX_SCHEDULER_RID_CHARS``, an empty prompt or one
                with an id outside the vocabulary, a prompt that cannot fit the context or the pool,
                a grammar and no grammar backend (a prompt counts its resumed output ids, see
                ``_check_resumed``); or (``BoundError``, naming the field) a sampling
                parameter outside ``pdserve.sampling.bounds``, ``top_k`` above the vocabulary,
                stop or bias token ids outside it, grammar text over its size, prompt logprobs of
                a prompt over ``MAX_PROMPT_LOGPROB_TOKENS``, a priority other than 0 under a
                policy other than ``priority`` (vLLM refuses it too), and an embedding (``embed``,
                which needs ``max_new_tokens`` 1) of a model whose pooling is not served, included.
            UnknownAdapter: (a ValueError) a ``lora_name`` this worker does not serve.
        """
        self.queue.check_room()
        lim = self.limits
        if not 0 < len(req.rid) <= MAX_SCHEDULER_RID_CHARS:
            raise ValueError(f"rid must have 1 to {MAX_SCHEDULER_RID_CHARS} characters")
        if req.rid in self._reqs or self._held(req.rid):  # draining: its prefill still runs
            raise DuplicateRid(f"duplicate rid {req.rid!r}")
        prompt = req.origin_input_ids
        if not prompt:
            raise ValueError("input_ids is empty")
        if not 0 <= min(prompt) <= max(prompt) < lim.vocab_size:
            raise ValueError(f"input_ids must be token ids in [0, {lim.vocab_size})")
        req.sampling_params.validate(lim.vocab_size)
        if req.sampling_params.priority and self.queue.policy.policy != "priority":
            raise BoundError("priority", "is only accepted under --schedule-policy priority (send 0)")
        if req.sampling_params.prompt_logprobs is not None and len(prompt) > MAX_PROMPT_LOGPROB_TOKENS:
            raise BoundError(
                "prompt_logprobs",
                f"needs a prompt of at most {MAX_PROMPT_LOGPROB_TOKENS} tokens, got {len(prompt)}",
            )
        if req.sampling_params.lora_name and req.sampling_params.lora_name not in lim.adapters:
            raise UnknownAdapter(req.sampling_params.lora_name)
        if req.sampling_params.embed and lim.pooling is None:
            raise BoundError("embed", "this model's sentence-transformers pooling mode is not served")
        self._check_resumed(req)
        fill = len(req.fill_ids)
        if fill + lim.prompt_room > lim.context_len:
            raise ValueError(f"prompt has {fill} tokens; context length is {lim.context_len}")
        if -(-(fill + 1) // lim.page_size) > lim.usable_pages:
            raise ValueError(
                f"prompt of {fill} tokens needs more KV pages than the pool has"
                f" ({lim.usable_pages} pages of {lim.page_size} tokens)"
            )
        self.queue.add(req)
        self._reqs[req.rid] = req
        self.metrics.prompt_tokens.inc(len(prompt))
        self.metrics.request_prompt_tokens.observe(len(prompt))
        return len(self.queue.waiting)

    def _check_resumed(self, req: Req) -> None:
        """A continuation's (or a retracted request's) output ids: fewer than ``max_new_tokens`` (one
        at least is left to generate), in the vocabulary, and none for an embedding.

        Raises:
            BoundError: naming ``resumed_output_ids``.
        """
        resumed = req.output_ids
        if not resumed:
            return
        if len(resumed) >= req.sampling_params.max_new_tokens or req.sampling_params.embed:
            raise BoundError(
                "resumed_output_ids",
                f"must be fewer than max_new_tokens ({req.sampling_params.max_new_tokens}), and none"
                f" for an embedding; got {len(resumed)}",
            )
        if not 0 <= min(resumed) <= max(resumed) < self.limits.vocab_size:
            raise BoundError("resumed_output_ids", f"must be token ids in [0, {self.limits.vocab_size})")

    # ---- exit ---------------------------------------------------------------------------
    def end(self, req: Req, reason: FinishReason, error: str = "") -> None:
        """``req`` ends (as ``reason``, unless it finished already): out of every queue, its KV
        released exactly once (see the module docstring), counted."""
        held = self._leave(req)
        if not req.state.done:
            req.finish(reason, error)
        if not held:
            valid_kv = reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)
            self.ledger.release_when_idle(req, cache=valid_kv and req.num_computed > 0)
        self._reqs.pop(req.rid, None)
        req.finish_time = self.clock()
        self.metrics.observe_end(req, self.counts_finishes)
        if self.on_request_end is not None:
            self.on_request_end(req)

    def end_now(self, req: Req, reason: FinishReason, error: str = "") -> None:
        """``end`` outside a step's results: its output is reported with ``pop_aborted``."""
        self.end(req, reason, error)
        self.aborted.append(StepOutput(req, finished=True))

    def abort(self, rid: str, reason: str, finish_reason: FinishReason = FinishReason.ABORT) -> bool:
        """Abort ``rid`` in whatever state it is, counted as ``finish_reason``; False if not held. A
        request inside a scheduled batch ends when that batch is processed (``Req.to_abort``)."""
        req = self._reqs.get(rid)
        if req is None:
            return False
        if not req.in_batches:
            self.end_now(req, finish_reason, reason)
        elif not req.to_abort:
            req.to_abort, req.abort_as = reason, finish_reason
        return True

    def fail_all(self, error: str) -> list[StepOutput]:
        """End every request with ERROR ``error``, retryable (the scheduler is going down, to restart)."""
        outputs = []
        for req in list(self._reqs.values()):
            req.retryable = True
            self.end(req, FinishReason.ERROR, error)
            outputs.append(StepOutput(req, finished=True))
        return outputs

    def end_overdue(self) -> None:
        """End what may wait no longer: requests past their deadline (``time.time()`` s), constrained
        requests whose grammar failed to compile, requests that waited past the queue's time limit
        (retryable)."""
        now = self.clock()
        for req in [r for r in self._reqs.values() if r.deadline and now > r.deadline and not r.to_abort]:
            self.abort(req.rid, "deadline exceeded")
        for req, error in self.queue.take_compiled():
            self.end_now(req, FinishReason.ERROR, error)
        for req, error in self.queue.take_overdue(self.clock()):
            req.retryable = True
            self.end_now(req, FinishReason.ERROR, error)

    def pop_aborted(self) -> list[StepOutput]:
        """Requests ended outside a step (abort, deadline, queue time, bad inputs) since the last call."""
        outputs, self.aborted = self.aborted, []
        return outputs
