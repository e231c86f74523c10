"""The scheduler core: admission, chunked prefill, continuous batching, retraction and abort.

Transport-free and single-threaded: every method is called from one thread (the service's event
loop); only ``run_batch`` (the forward) runs on a worker thread.

Deterministic in its inputs: given the same requests, aborts and KV events in the same order, and
the same ``clock`` readings, two schedulers make the same decisions (batches, pages, radix-cache
operations). The ranks of a tensor-parallel scheduler rely on that (``state_digest`` checks it).

The step is schedule → run → process (cf. SGLang's ``event_loop_normal``):

    batch = scheduler.schedule()
    result = scheduler.run_batch(batch)          # may run in an executor
    outputs = scheduler.process_result(batch, result)

and it may overlap (SGLang's ``event_loop_overlap``): the next ``schedule()`` may come before the
previous batch's ``process_result``, while its forward runs. Everything that does not depend on the
sampled token ids is decided when a batch is scheduled (KV positions, chunk progress, a prompt's
last chunk turning into a decoding request), so the next batch can be built at once: a request
whose token is still being sampled decodes it as a *pending* input that the forward thread fills in
from the previous batch's result (``ScheduleBatch.resolve``). What depends on the token ids waits
for ``process_result``: appending tokens, finishing (EOS, stop tokens), radix inserts, outputs.
A request that a pending token will bring to its length limit is not scheduled again; one that
stops at EOS runs one wasted row. The KV of a request that ends while a scheduled batch still
holds it is released when the last such batch is processed (``Req.in_batches``), so no forward
reads a page or request slot that was given to another request. Where a step would need token ids
that are still pending (penalties over the output, a grammar's next mask, or a retraction of a
request in flight),
``schedule()`` returns None with ``needs_results`` set: the caller processes the batch in flight
first and schedules again.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.constrained.backend import GrammarBackend
from pdserve.sampling.bounds import MAX_SCHEDULER_RID_CHARS
from pdserve.scheduler.batch_runner import run_batch
from pdserve.scheduler.grammar_queue import GrammarQueue
from pdserve.scheduler.kv_ledger import KVLedger
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.overload import (
    DEFAULT_MAX_QUEUE_TIME_S,
    QueueFull,
    check_queue_room,
    overdue,
    queue_bound,
    request_capacity,
)
from pdserve.scheduler.policy import SchedulePolicy
from pdserve.scheduler.req import FinishReason, Req, ReqState
from pdserve.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)

ROLES = ("mixed", "prefill", "decode")
IN_BATCH_PREFIX_TOKENS = 32  # a shared uncached prefix at least this long is computed once, not twice


class DuplicateRid(ValueError):
    """A request whose rid the scheduler already holds (running, queued, or its KV still draining):
    nothing was queued, and the request holding the rid goes on."""


@dataclass
class SchedulerConfig:
    """Scheduling knobs (CLI flags of the prefill/decode services).

    Raises ValueError from ``validate`` on a bad value.
    """

    role: str = "mixed"
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    new_token_reserve: int = 32  # tokens reserved per request at admission, beyond its prompt
    grammar_compile_timeout: float = 20.0  # seconds a constrained request may wait for its grammar
    max_queued_requests: int | None = None  # waiting-queue bound; None = auto, 0 = none (see overload.py)
    max_queue_time: float = DEFAULT_MAX_QUEUE_TIME_S  # seconds a request may wait unadmitted; 0 = no limit

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.chunked_prefill_size < 16:
            raise ValueError("chunked_prefill_size must be >= 16 tokens")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0 (0 = no bound)")
        if self.max_queue_time < 0:
            raise ValueError("max_queue_time must be >= 0 (0 = no limit)")


@dataclass
class StepOutput:
    """What one request produced in one step (or how it ended)."""

    req: Req
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False


class Scheduler:
    """One scheduler of one role over one ``ModelRunner``.

    Args:
        runner: the engine (``pdserve.engine.tp_worker.TpModelWorker``, or a ``ModelRunner``), whose
            pools it schedules.
        config: scheduling knobs.
        metrics: Prometheus metrics of this process; a private registry when omitted.
        grammar_backend: compiles the grammars of constrained requests; without one, such
            requests are refused.

    Attributes:
        clock: the time source of every scheduling decision (deadlines, admission order, lpm
            starvation), ``time.time`` by default; a TP group sets rank 0's reading of each step.
    """

    def __init__(
        self,
        runner,
        config: SchedulerConfig,
        metrics: SchedulerMetrics | None = None,
        grammar_backend: GrammarBackend | None = None,
    ) -> None:
        config.validate()
        self.clock: Callable[[], float] = time.time
        self.runner = runner
        self.config = config
        self.role = config.role
        self.page_size = runner.token_to_kv_pool_allocator.page_size
        self.ledger = KVLedger(
            runner.req_to_token_pool,
            runner.token_to_kv_pool_allocator,
            self.page_size,
            disable_radix_cache=config.disable_radix_cache,
        )
        self.usable_pages = self.ledger.free_pages()
        # a request ends with "length" when it reaches the context or fills the whole pool alone
        self.max_req_tokens = min(runner.model_config.context_length, self.usable_pages * self.page_size)
        self.context_len = runner.model_config.context_length
        self.eos_token_ids = list(runner.model_config.eos_token_ids)
        self.vocab_size = runner.model_config.vocab_size
        self.policy = SchedulePolicy(config.schedule_policy, self._cached_prefix_len, lambda: self.clock())
        self.metrics = metrics or SchedulerMetrics(config.role)
        self.reqs: dict[str, Req] = {}
        self.grammar_queue = GrammarQueue(grammar_backend, config.grammar_compile_timeout, self.metrics)
        self.waiting: list[Req] = []
        self.prefilling: list[Req] = []  # admitted, extending in chunks (mixed / prefill roles)
        self.running: list[Req] = []  # decoding (mixed / decode roles)
        self.waiting_for_kv: dict[str, Req] = {}  # decode role: pages reserved, prefill asked
        # decode role: ended while their prompt KV was arriving; pages held until ``kv_drained``
        self.kv_draining: dict[str, Req] = {}
        self.kv_requests: list[Req] = []  # decode role: admitted, the servicer must ask a prefill worker
        self.prefilled: list[Req] = []  # prefill role: first token sampled, KV ready to send
        self.outstanding: list[ScheduleBatch] = []  # scheduled, not processed yet (oldest first)
        self.needs_results = False  # the last schedule() needs the outstanding batch processed first
        self.aborted_outputs: list[StepOutput] = []
        # called with every request as it ends (finish, abort, failure), after its pages are released
        self.on_request_end: Callable[[Req], None] | None = None
        # decode role: called with a request that ends while its prompt KV is still arriving (abort,
        # deadline, failure), so the transfer writing it can be stopped; its pages are then held
        # (``kv_draining``) until ``kv_drained``: a prefill worker may still be writing into them
        self.on_kv_abandoned: Callable[[Req], None] | None = None
        min_pages = self.ledger.pages_for(1 + config.new_token_reserve)
        self.request_capacity = request_capacity(config.max_running_requests, self.usable_pages, min_pages)
        self.max_queued_requests = queue_bound(config.max_queued_requests, self.request_capacity)

    # ---- requests in ----------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a new request, checked as the gateway checks it (internal ports are reachable too);
        a constrained one waits in the grammar queue until its grammar compiled (``grammar_future``
        tells when).

        Raises:
            DuplicateRid: (a ValueError) the rid is held by another request.
            ValueError: an empty rid or one over ``MAX_SCHEDULER_RID_CHARS``, an empty prompt or one
                with an id outside the vocabulary, a prompt that cannot fit the context or the pool,
                a grammar this scheduler cannot compile (no backend); or (``BoundError``, naming
                the field) a sampling parameter outside ``pdserve.sampling.bounds``, ``top_k`` above
                the vocabulary, stop or bias token ids outside it and grammar text over its size
                included.
            QueueFull: the waiting queue (with the grammar queue) is at its bound.
        """
        self._check_queue_room()
        if not 0 < len(req.rid) <= MAX_SCHEDULER_RID_CHARS:
            raise ValueError(f"rid must have 1 to {MAX_SCHEDULER_RID_CHARS} characters")
        if req.rid in self.reqs or req.rid in self.kv_draining:  # draining: its prefill still runs
            raise DuplicateRid(f"duplicate rid {req.rid!r}")
        if not req.origin_input_ids:
            raise ValueError("input_ids is empty")
        if not 0 <= min(req.origin_input_ids) <= max(req.origin_input_ids) < self.vocab_size:
            raise ValueError(f"input_ids must be token ids in [0, {self.vocab_size})")
        req.sampling_params.validate(self.vocab_size)
        total = len(req.origin_input_ids) + (1 if self.role == "prefill" else 0)
        if total > self.context_len:
            raise ValueError(
                f"prompt has {len(req.origin_input_ids)} tokens; context length is {self.context_len}"
            )
        if self.ledger.pages_for(len(req.origin_input_ids) + 1) > self.usable_pages:
            raise ValueError(
                f"prompt of {len(req.origin_input_ids)} tokens needs more KV pages than the pool has"
                f" ({self.usable_pages} pages of {self.page_size} tokens)"
            )
        if req.sampling_params.grammar is not None:
            self.grammar_queue.add(req)
        else:
            self.waiting.append(req)
        self.reqs[req.rid] = req
        self.metrics.prompt_tokens.inc(len(req.origin_input_ids))
        self.metrics.request_prompt_tokens.observe(len(req.origin_input_ids))

    def grammar_future(self, rid: str):
        """The compile ``rid`` waits for in the grammar queue (a ``concurrent.futures.Future`` that
        resolves to the compiled grammar or raises ``GrammarError``), or None."""
        return self.grammar_queue.future(rid)

    def abort_request(
        self, rid: str, reason: str = "aborted", finish_reason: FinishReason = FinishReason.ABORT
    ) -> bool:
        """Abort ``rid`` in whatever state it is; pages are released exactly once. It ends (and is
        counted) as ``finish_reason``: ABORT, or STOP for a stop string the detokenizer matched.

        Returns False when the rid is unknown (already finished). A request inside a scheduled batch
        is aborted when that batch is processed (and scheduled no more meanwhile).
        """
        req = self.reqs.get(rid)
        if req is None:
            return False
        if req.in_batches:
            if not req.to_abort:
                req.to_abort, req.abort_as = reason, finish_reason
            return True
        self._end(req, finish_reason, reason)
        self.aborted_outputs.append(StepOutput(req, finished=True))
        return True

    # ---- decode role: KV from a prefill worker ------------------------------------------
    def pop_kv_requests(self) -> list[Req]:
        """Requests just admitted in the decode role; the servicer asks a prefill worker for each."""
        reqs, self.kv_requests = self.kv_requests, []
        return reqs

    def kv_ready(self, rid: str, first_token_id: int, logprob=None) -> StepOutput | None:
        """The prefill worker wrote ``rid``'s prompt KV into our pages and sampled its next token
        (under the request's grammar, if it has one: our own matcher advances by that token)."""
        req = self.waiting_for_kv.pop(rid, None)
        if req is None:
            return None
        req.num_computed = len(req.fill_ids)
        self.ledger.cache_unfinished(req)
        self._append_token(req, first_token_id, logprob)
        self.metrics.generation_tokens.inc()
        req.set_state(ReqState.RUNNING)
        req.check_finished(self.eos_token_ids, self.max_req_tokens)
        if req.state.done:
            self._end(req, req.finish_reason)
        else:
            self.running.append(req)
        return StepOutput(req, [first_token_id], finished=req.state.done)

    def kv_failed(self, rid: str, error: str, retryable: bool = False) -> StepOutput | None:
        """The prefill for ``rid`` failed for good: free its pages and fail it (``retryable``: for a
        reason of the servers' state, such as every prefill worker down or hung)."""
        req = self.waiting_for_kv.get(rid)  # _end pops it, after stopping its transfer
        if req is None:
            return None
        req.retryable = retryable
        self._end(req, FinishReason.ERROR, error)
        return StepOutput(req, finished=True)

    def kv_drained(self, rid: str) -> None:
        """No prefill worker writes into ``rid``'s pages any more (its Prefill call ended): release the
        pages of a request that ended while they were arriving. No-op for any other rid."""
        req = self.kv_draining.pop(rid, None)
        if req is not None:
            self.ledger.release(req, cache=False)

    # ---- prefill role: KV sent ----------------------------------------------------------
    def pop_prefilled(self) -> list[Req]:
        """Requests whose prompt KV is complete in the prefill role (first token in output_ids)."""
        reqs, self.prefilled = self.prefilled, []
        return reqs

    def computed_tokens(self, req: Req) -> int:
        """Tokens of ``req`` whose KV is in the pool now: ``num_computed`` less the tokens of the
        scheduled batches not processed yet (their forwards may still be writing them)."""
        n = req.num_computed
        if req.in_batches:
            for batch in self.outstanding:
                n -= sum(batch.extend_lens[i] for i, r in enumerate(batch.reqs) if r is req)
        return n

    def prefill_sent(self, rid: str, ok: bool, error: str = "") -> None:
        """The KV write of a prefilled request ended: cache its pages (or free them) and forget it."""
        req = self.reqs.get(rid)
        if req is None:
            return
        self._end(req, FinishReason.STOP if ok else FinishReason.ERROR, error)

    # ---- the step -----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(
            self.waiting or self.prefilling or self.running or self.outstanding or len(self.grammar_queue)
        )

    def schedule(self) -> ScheduleBatch | None:
        """Pick this step's requests (chunks of extends within the token budget, then decodes), build
        its forward batch and advance the requests' counters for it.

        Returns None when there is nothing to run, or when the step needs the token ids of the
        outstanding batch first (``needs_results``).
        """
        self.needs_results = False
        self._expire_deadlines()
        self._take_compiled_grammars()
        self._expire_queue_time()
        if self.role == "decode":
            self._admit_for_kv()
        if self.outstanding and any(
            r.num_pending and (r.sampling_params.has_penalties or r.grammar is not None) for r in self.running
        ):
            # penalties count the output tokens, and a grammar's mask follows from them: they must be
            # known (a matcher is advanced on this thread, by process_result, before it masks again)
            self.needs_results = True
            return None
        decodes = self._prepare_decodes() if self.role != "prefill" else []
        if decodes is None:
            self.needs_results = True
            return None
        extends, extend_lens = self._schedule_extends() if self.role != "decode" else ([], [])
        self._update_gauges()
        if not extends and not decodes:
            return None
        batch = self._prepare(
            ScheduleBatch(extends + decodes, extend_lens + [1] * len(decodes), len(extends))
        )
        if batch is not None:
            self._launch(batch)
        return batch

    def run_batch(self, batch: ScheduleBatch):
        """Run the forward of ``batch`` (thread-safe with respect to the request queues); returns its
        result. A forward that raises fails only the requests responsible (``batch_runner``)."""
        return run_batch(self.runner, batch).result

    def process_result(self, batch: ScheduleBatch, result=None) -> list[StepOutput]:
        """Apply the sampled tokens of ``batch`` (the oldest outstanding one); finish, hand over or
        keep each request."""
        if result is not None:
            batch.result = result
        self.outstanding.remove(batch)
        result = batch.result
        now = self.clock()
        outputs: list[StepOutput] = []
        generated = 0
        for i, req in enumerate(batch.reqs):
            req.in_batches -= 1
            sampled = batch.samples[i]
            req.num_pending -= sampled
            if req.state.done:  # ended while this batch ran: only its KV was waiting for it
                self._release_deferred(req)
                continue
            if req.to_abort or i in batch.row_errors:
                reason = req.abort_as if req.to_abort else FinishReason.ERROR
                self._end(req, reason, req.to_abort or batch.row_errors[i])
                outputs.append(StepOutput(req, finished=True))
                continue
            if not sampled:  # a non-final chunk of a long prompt: its sample is discarded
                self.ledger.cache_unfinished(req)
                continue
            logprob = None
            if result.next_token_logprobs is not None:
                top = result.top_logprobs[i] if result.top_logprobs is not None else []
                logprob = (result.next_token_logprobs[i], top)
            token = result.next_token_ids[i]
            self._append_token(req, token, logprob, now)
            generated += 1
            if i < batch.num_extend:
                self.ledger.cache_unfinished(req)
                if self.role == "prefill":
                    self.prefilled.append(req)
                    continue
            req.check_finished(self.eos_token_ids, self.max_req_tokens)
            if req.state.done:
                self._end(req, req.finish_reason)
            outputs.append(StepOutput(req, [token], finished=req.state.done))
        self.metrics.generation_tokens.inc(generated)
        self._update_gauges()
        return outputs

    def fail_batch(self, batch: ScheduleBatch, error: str) -> list[StepOutput]:
        """The whole step failed outside the forward: fail every request of ``batch``."""
        batch.row_errors = dict.fromkeys(range(len(batch.reqs)), error)
        return self.process_result(batch)

    def fail_all(self, error: str) -> list[StepOutput]:
        """End every request with ERROR ``error``, retryable (the scheduler is going down, to restart)."""
        outputs = []
        for req in list(self.reqs.values()):
            req.retryable = True
            self._end(req, FinishReason.ERROR, error)
            outputs.append(StepOutput(req, finished=True))
        return outputs

    def pop_aborted(self) -> list[StepOutput]:
        """Requests ended outside a step (explicit abort, deadline, queue time) since the last call."""
        outputs, self.aborted_outputs = self.aborted_outputs, []
        return outputs

    def _prepare(self, batch: ScheduleBatch) -> ScheduleBatch | None:
        """Build ``batch``'s forward batch; a request whose parameters make that raise fails alone
        (found by building each request's sampling tensors on their own) and the rest is rebuilt."""
        prev = self.outstanding[-1] if self.outstanding else None
        try:
            batch.prepare(self.runner, prev)
            return batch
        except Exception as e:  # narrowed to the requests responsible below
            logger.warning("building a batch of %d requests failed (%s): isolating", len(batch.reqs), e)
        keep = []
        for i, req in enumerate(batch.reqs):
            try:
                ScheduleBatch([req], [batch.extend_lens[i]], int(i < batch.num_extend)).prepare(
                    self.runner, prev
                )
                keep.append(i)
            except Exception as e:  # this request's inputs are the cause
                self._end(req, FinishReason.ERROR, f"invalid sampling inputs: {type(e).__name__}: {e}")
                self.aborted_outputs.append(StepOutput(req, finished=True))
        if not keep:
            return None
        num_extend = sum(i < batch.num_extend for i in keep)
        rest = ScheduleBatch([batch.reqs[i] for i in keep], [batch.extend_lens[i] for i in keep], num_extend)
        try:
            rest.prepare(self.runner, prev)
        except Exception as e:  # no single request is the cause: fail the step's requests
            logger.exception("building a batch failed")
            for req in rest.reqs:
                self._end(req, FinishReason.ERROR, f"building the batch failed: {type(e).__name__}: {e}")
                self.aborted_outputs.append(StepOutput(req, finished=True))
            return None
        return rest

    def _launch(self, batch: ScheduleBatch) -> None:
        """Advance every request's counters for ``batch`` as if it had run (see the module docstring);
        a prompt whose last chunk runs becomes a decoding request (mixed role) now."""
        for i, req in enumerate(batch.reqs):
            req.num_computed += batch.extend_lens[i]
            req.in_batches += 1
            req.last_row = i
            if not batch.samples[i]:
                continue
            req.num_pending += 1
            if i < batch.num_extend:
                self.prefilling.remove(req)
                if self.role != "prefill":
                    req.set_state(ReqState.RUNNING)
                    self.running.append(req)
        self.outstanding.append(batch)

    # ---- internals ----------------------------------------------------------------------
    def _take_compiled_grammars(self) -> None:
        """Requests whose grammar compiled join the waiting queue; those whose compile failed end."""
        ready, failed = self.grammar_queue.pop_done()
        self.waiting += ready
        for req, error in failed:
            self._end(req, FinishReason.ERROR, error)
            self.aborted_outputs.append(StepOutput(req, finished=True))

    def _cached_prefix_len(self, req: Req) -> int:
        return self.ledger.tree.match_prefix(req.fill_ids[:-1]).num_tokens

    def _append_token(self, req: Req, token: int, logprob, now: float | None = None) -> None:
        now = now or self.clock()
        req.output_ids.append(token)
        if req.grammar is not None:
            req.grammar.accept(token)  # a refusal fails the request in check_finished
        if logprob is not None:
            req.output_logprobs.append((token, logprob[0], logprob[1]))
        if req.first_token_time == 0.0:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.arrival_time)
        else:
            self.metrics.itl.observe(now - req.last_token_time)
        req.last_token_time = now

    def _can_run_more(self) -> int:
        active = len(self.running) + len(self.prefilling) + len(self.waiting_for_kv)
        return self.config.max_running_requests - active

    def _pages_to_grow(self, req: Req) -> int:
        """Pages ``req`` still lacks for its fill plus a reserve of up to ``new_token_reserve`` next
        tokens (counted in tokens, so a partly filled last page takes them first)."""
        remaining = req.sampling_params.max_new_tokens - req.num_generated
        tokens = req.seq_len + max(0, min(remaining, self.config.new_token_reserve))
        return max(0, self.ledger.pages_for(min(tokens, self.max_req_tokens)) - len(req.pages))

    def _admissible(self, req: Req) -> bool:
        """Admission by KV budget: the request's fill and reserve, and every running request's reserve."""
        need = self._pages_to_grow(req) + sum(self._pages_to_grow(r) for r in self.running)
        return need <= self.ledger.available_pages()

    def _admit(self, req: Req) -> bool:
        """Match the radix cache, lock the match and allocate pages for the whole fill."""
        prefix = self.ledger.match(req)
        if not self._admissible(req) or not self.ledger.admit(req, req.seq_len):
            self.ledger.unmatch(req)
            return False
        if not req.output_ids:  # a retracted request re-admitted is not a new prompt
            req.cached_tokens = prefix
            self.metrics.prefix_cache_queries.inc(len(req.origin_input_ids))
            self.metrics.prefix_cache_hit_tokens.inc(prefix)
        req.admit_time = self.clock()
        self.metrics.queue_time.observe(req.admit_time - req.arrival_time)
        self.waiting.remove(req)
        return True

    def _admit_for_kv(self) -> None:
        self.policy.order(self.waiting)
        for req in list(self.waiting):
            if self._can_run_more() <= 0:
                break
            if self._waits_for_shared_prefix(req):
                continue
            if not self._admit(req):
                break
            req.set_state(ReqState.WAITING_FOR_KV)
            self.waiting_for_kv[req.rid] = req
            self.kv_requests.append(req)

    def _schedule_extends(self) -> tuple[list[Req], list[int]]:
        budget = self.config.chunked_prefill_size
        reqs: list[Req] = []
        lens: list[int] = []
        for req in self.prefilling:  # continue chunked requests first
            if budget <= 0:
                break
            if req.to_abort:  # ends when its batch in flight is processed
                continue
            n = min(budget, req.seq_len - req.num_computed)
            reqs.append(req)
            lens.append(n)
            budget -= n
        self.policy.order(self.waiting)
        for req in list(self.waiting):
            if budget <= 0 or self._can_run_more() <= 0:
                break
            if self._waits_for_shared_prefix(req):
                continue
            if not self._admit(req):
                break
            req.set_state(ReqState.PREFILLING)
            self.prefilling.append(req)
            n = min(budget, req.seq_len - req.num_computed)
            reqs.append(req)
            lens.append(n)
            budget -= n
        return reqs, lens

    def _waits_for_shared_prefix(self, req: Req) -> bool:
        """Whether ``req`` should wait because a request whose prompt KV is being made right now
        (extending here, or in the decode role, being prefilled by a prefill worker) shares with it
        a prefix beyond what the cache holds of at least ``IN_BATCH_PREFIX_TOKENS`` tokens.

        Once that KV is complete its pages are in the cache and ``req`` extends (or has transferred)
        only its own suffix, instead of both computing and, in PD, both shipping the shared part
        side by side (SGLang's in-batch prefix caching). Never with the cache disabled, where
        waiting saves nothing.
        """
        if self.role == "decode":
            in_flight = list(self.waiting_for_kv.values())
        else:  # extending now, or in a batch still running whose chunks enter the cache when processed
            in_flight = self.prefilling + [r for b in self.outstanding for r in b.reqs[: b.num_extend]]
        if self.config.disable_radix_cache or not in_flight:
            return False
        shared = max(_common_prefix_len(req.fill_ids, other.fill_ids) for other in in_flight)
        if shared < IN_BATCH_PREFIX_TOKENS:
            return False
        return shared - self._cached_prefix_len(req) >= IN_BATCH_PREFIX_TOKENS

    def _prepare_decodes(self) -> list[Req] | None:
        """Give every running request a KV slot for its next token, retracting the newest if short.

        Skips requests being aborted and those whose pending tokens end them by length. Returns None
        when a retraction is due while a batch is in flight (its requests' KV must stay where that
        forward reads it): the caller processes that batch and schedules again.
        """
        # oldest first; the victim of a retraction is the newest still running in this same order, so
        # never a request already in ``batch`` (admit times tie when a step admits several requests)
        order = sorted(self.running, key=lambda r: r.admit_time)

        def wants_slot(req: Req) -> bool:  # False too once retracted to make room for an older one
            if req.state is not ReqState.RUNNING or req.to_abort:
                return False
            return not (req.num_pending and req.will_finish_by_length(self.max_req_tokens))

        batch = [req for req in order if wants_slot(req)]
        if self.ledger.grow_all(batch, [req.seq_len for req in batch]):
            return batch  # the usual case: the pool has a page for everyone who needs one
        batch = []
        for req in order:
            if not wants_slot(req):
                continue
            while not self.ledger.grow(req, req.seq_len):
                if self.outstanding:
                    return None
                victim = next(r for r in reversed(order) if r.state is ReqState.RUNNING)
                self._retract(victim)
                if victim is req:
                    break
            else:
                batch.append(req)
        return batch

    def _retract(self, req: Req) -> None:
        """Give ``req``'s pages back (its computed KV goes to the radix cache) and re-queue it."""
        logger.info(
            "retracting %s (%d tokens generated) to free KV pages",
            req.rid,
            len(req.output_ids),
            extra={"rid": req.rid},
        )
        self.running.remove(req)
        self.ledger.release(req, cache=True)
        req.set_state(ReqState.WAITING)
        self.waiting.insert(0, req)
        self.metrics.retracted.inc()

    def _expire_deadlines(self) -> None:
        now = self.clock()
        for req in list(self.reqs.values()):
            if req.deadline and now > req.deadline and not req.to_abort:
                self.abort_request(req.rid, "deadline exceeded")

    def _check_queue_room(self) -> None:
        try:
            check_queue_room(len(self.waiting) + len(self.grammar_queue), self.max_queued_requests)
        except QueueFull:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise

    def _expire_queue_time(self) -> None:
        """Fail (retryable) every request that waited past ``max_queue_time`` without being admitted.

        Not in the prefill role: there the decode worker owns the request and its deadline.
        """
        if self.role == "prefill":
            return
        for req, error in overdue(self.waiting, self.clock(), self.config.max_queue_time):
            logger.warning("%s: %s", req.rid, error)
            req.retryable = True
            self._end(req, FinishReason.ERROR, error)
            self.aborted_outputs.append(StepOutput(req, finished=True))
            self.metrics.rejected.labels(reason="queue_time").inc()

    def _end(self, req: Req, reason: FinishReason, error: str = "") -> None:
        """Leave every queue and release the KV ledger entry, exactly once."""
        for queue in (self.waiting, self.prefilling, self.running, self.prefilled):
            if req in queue:
                queue.remove(req)
        abandoned = self.waiting_for_kv.pop(req.rid, None) is not None and self.on_kv_abandoned is not None
        if abandoned:
            self.on_kv_abandoned(req)
        self.grammar_queue.remove(req)
        if not req.state.done:
            req.finish(reason, error)
        valid_kv = reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)
        cache = valid_kv and req.num_computed > 0
        if req.in_batches:  # a scheduled forward still reads and writes its KV
            req.release_cache = cache
        elif abandoned:  # a prefill worker may still write its pages
            self.kv_draining[req.rid] = req
        else:
            self.ledger.release(req, cache=cache)
        self.reqs.pop(req.rid, None)
        req.finish_time = self.clock()
        if req.first_token_time:
            self.metrics.e2e.observe(req.finish_time - req.arrival_time)
        if self.role != "prefill":  # a prefill worker hands requests on; they end on decode
            self.metrics.finished.labels(finish_reason=req.finish_reason.value).inc()
            self.metrics.request_generation_tokens.observe(len(req.output_ids))
        if self.on_request_end is not None:
            self.on_request_end(req)

    def _release_deferred(self, req: Req) -> None:
        """Release the KV of an ended request once no scheduled batch holds it any more."""
        if req.in_batches == 0 and req.release_cache is not None:
            self.ledger.release(req, cache=req.release_cache)
            req.release_cache = None

    def _update_gauges(self) -> None:
        m = self.metrics
        m.num_running.set(len(self.running) + len(self.prefilling) + len(self.waiting_for_kv))
        m.num_queue.set(len(self.waiting) + len(self.grammar_queue))
        m.kv_pages_used.set(self.ledger.used_pages())
        m.kv_pages_free.set(self.ledger.free_pages())
        m.kv_pages_cached.set(self.ledger.cached_pages())
        m.kv_pages_total.set(self.usable_pages)
        m.kv_cache_usage.set(self.ledger.used_pages() / self.usable_pages if self.usable_pages else 0.0)

    def check_invariants(self) -> None:
        """Raise AssertionError if KV pages are not conserved."""
        self.ledger.check_conservation(self.usable_pages)

    def state_digest(self) -> str:
        """A hash of the scheduling state every TP rank must hold identically: each queue's requests
        in order with their progress and KV pages, and the pool's free / cached / used page counts."""
        h = hashlib.blake2b(digest_size=16)
        for queue in (
            self.waiting,
            self.prefilling,
            self.running,
            self.prefilled,
            self.waiting_for_kv.values(),
            self.kv_draining.values(),
        ):
            for r in queue:
                h.update(
                    repr(
                        (r.rid, r.state.value, r.num_computed, r.output_ids, r.pages, r.req_pool_idx)
                    ).encode()
                )
            h.update(b"|")
        ledger = self.ledger
        h.update(repr((ledger.free_pages(), ledger.cached_pages(), ledger.used_pages())).encode())
        return h.hexdigest()


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on slice equality (C-speed compares)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
