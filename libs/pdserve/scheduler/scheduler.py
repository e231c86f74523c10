"""``Scheduler``: the managers of this package composed for one role, one step at a time.

Transport-free and single-threaded: every method is called from one thread (the service's event
loop); only ``run_batch`` (the forward) runs on a worker thread. Deterministic in its inputs: given
the same requests, aborts and KV events in the same order, and the same ``clock`` readings, two
schedulers make the same decisions (the ranks of a tensor-parallel scheduler rely on that, and
``state_digest`` checks it). Its interface, and the contract of the overlapped step, are in the
package docstring.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.constrained.backend import GrammarBackend
from pdserve.mem_cache.kv_tier import make_tier
from pdserve.scheduler.admission import Admission
from pdserve.scheduler.batch_runner import run_batch
from pdserve.scheduler.config import SchedulerConfig
from pdserve.scheduler.decode import DecodeManager
from pdserve.scheduler.digest import state_digest
from pdserve.scheduler.grammar_queue import GrammarQueue
from pdserve.scheduler.handoff import HandOff
from pdserve.scheduler.kv_ledger import KVLedger
from pdserve.scheduler.metrics import SchedulerLoad, SchedulerMetrics
from pdserve.scheduler.output_processor import OutputProcessor
from pdserve.scheduler.overload import queue_bound, request_capacity
from pdserve.scheduler.policy import SchedulePolicy
from pdserve.scheduler.preempt import Preemption
from pdserve.scheduler.prefill import PrefillManager
from pdserve.scheduler.remote_prefill import RemotePrefill
from pdserve.scheduler.req import FinishReason, Req
from pdserve.scheduler.schedule_batch import ScheduleBatch, StepOutput, kv_written, prepare_batch
from pdserve.scheduler.speculator import Speculator
from pdserve.scheduler.table import RequestLimits, RequestTable
from pdserve.scheduler.waiting import WaitingQueue

Hook = Callable[[Req], None]


class Scheduler:
    """One scheduler of one role over one ``ModelRunner``: ``reqs`` (the request table), ``queue``
    (the waiting queue), ``ledger`` (the KV ledger), and the role's stages ``prefill`` and ``decode``.

    Args:
        runner: the engine (``pdserve.engine.tp_worker.TpModelWorker``, or a ``ModelRunner``), whose
            pools it schedules.
        config: scheduling knobs.
        metrics: Prometheus metrics of this process; a private registry when omitted.
        grammar_backend: compiles the grammars of constrained requests; without one, such
            requests are refused.
        proposer: drafts tokens for speculative decoding (``pdserve.speculative``) in the roles that
            decode (mixed, decode); None decodes one token per request and step.

    Attributes:
        clock: the time of every scheduling decision (deadlines, admission order, lpm starvation),
            ``time.time`` by default; a TP group sets rank 0's reading of each step.
        needs_results: the last ``schedule()`` needs the outstanding batch processed first.
    """

    def __init__(
        self,
        runner,
        config: SchedulerConfig,
        metrics: SchedulerMetrics | None = None,
        grammar_backend: GrammarBackend | None = None,
        proposer=None,
    ) -> None:
        config.validate()
        self.clock: Callable[[], float] = time.time
        self.runner, self.config, self.role = runner, config, config.role
        self.page_size = runner.token_to_kv_pool_allocator.page_size
        self.metrics = metrics = metrics or SchedulerMetrics(config.role)
        pools = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
        kv_extras = runner.swa_pages, runner.lora_manager, make_tier(runner, config.kv_tier_memory), metrics
        self.ledger = KVLedger(*pools, self.page_size, config.disable_radix_cache, *kv_extras)
        self.usable_pages = self.ledger.free_pages()
        model = runner.model_config
        # a request ends with "length" when it reaches the context or fills the whole pool alone
        self.max_req_tokens = min(model.context_length, self.usable_pages * self.page_size)
        self.eos_token_ids = list(model.eos_token_ids)
        min_pages = self.ledger.pages_for(1 + config.new_token_reserve)
        self.request_capacity = request_capacity(config.max_running_requests, self.usable_pages, min_pages)
        self.outstanding: list[ScheduleBatch] = []  # scheduled, not processed yet (oldest first)
        self.needs_results = False
        clock = lambda: self.clock()  # (a TP loop replaces ``self.clock``)

        # The role is read here only, to pick the two stages. A prefill worker hands its requests on
        # to their decode worker, which owns them: their time in the queue, their finish.
        hands_on = config.role == "prefill"
        policy = SchedulePolicy(config.schedule_policy, self.ledger.cached_prefix_len, clock)
        grammars = GrammarQueue(grammar_backend, config.grammar_compile_timeout, metrics)
        bound = queue_bound(config.max_queued_requests, self.request_capacity)
        self.queue = WaitingQueue(
            policy, grammars, bound, 0.0 if hands_on else config.max_queue_time, metrics
        )
        self.speculator = None
        if proposer is not None and not hands_on:
            k, spec_policy = config.speculative_num_draft_tokens, config.speculative_policy
            self.speculator = Speculator(proposer, k, spec_policy, metrics, model.vocab_size, clock)
        self.decode: DecodeManager | HandOff = (
            HandOff()
            if hands_on
            else DecodeManager(self.ledger, self.queue, policy, metrics, self.max_req_tokens, self.speculator)
        )
        adapters = {} if runner.lora_manager is None else runner.lora_manager.adapters
        sizes = (model.vocab_size, model.context_length, self.decode.prompt_room, self.usable_pages)
        limits = RequestLimits(*sizes, self.page_size, model.pooling, adapters)
        held = lambda rid: rid in self.prefill.draining
        counts = self.decode.finishes_requests
        self.reqs = RequestTable(limits, self.queue, self.ledger, metrics, clock, self._leave, held, counts)
        running = lambda: self.decode.running
        admission = Admission(
            self.queue, self.ledger, metrics, clock, config, self.max_req_tokens, self._num_active, running
        )
        ends = self.eos_token_ids, self.max_req_tokens
        stages = self.reqs, self.ledger, self.decode, self.speculator
        self.output = OutputProcessor(*stages, metrics, *ends, clock)
        self.prefill: PrefillManager | RemotePrefill = (
            RemotePrefill(admission, self.output.first_token, self.reqs.end)
            if config.role == "decode"
            else PrefillManager(admission, self.outstanding)
        )
        preempts = config.schedule_policy == "priority" and isinstance(self.decode, DecodeManager)
        self.preemption = Preemption(admission, self.decode, policy) if preempts else None

    # ---- requests in, and what is held ---------------------------------------------------------
    def add_request(self, req: Req) -> int:
        """Queue a new request, checked as the gateway checks it (``RequestTable.add``, which says what
        it raises: QueueFull, DuplicateRid, ValueError); returns its place in the waiting queue."""
        return self.reqs.add(req)

    def abort_request(
        self, rid: str, reason: str = "aborted", finish_reason: FinishReason = FinishReason.ABORT
    ) -> bool:
        """Abort ``rid`` in whatever state it is; pages are released exactly once. It ends (and is
        counted) as ``finish_reason``: ABORT, or STOP for a stop string the detokenizer matched.
        False when the rid is unknown (already finished)."""
        return self.reqs.abort(rid, reason, finish_reason)

    def set_hooks(self, on_request_end: Hook | None = None, on_kv_abandoned: Hook | None = None) -> None:
        """Set the hooks given. ``on_request_end(req)``: called as each request ends, its pages
        released. Decode role: ``on_kv_abandoned(req)``, called as a request ends while its prompt KV
        arrives (to stop the transfer); its pages then wait for ``kv_drained``."""
        if on_request_end is not None:
            self.reqs.on_request_end = on_request_end
        if on_kv_abandoned is not None:
            self.prefill.on_abandoned = on_kv_abandoned

    def grammar_future(self, rid: str):
        return self.queue.grammars.future(rid)

    def grammar_timeout_reason(self, req: Req) -> tuple[str, bool]:
        return self.queue.grammars.timeout_reason(req)

    def request(self, rid: str) -> Req | None:
        """The request ``rid`` while it is held (queued or admitted, not ended), else None."""
        return self.reqs.get(rid)

    def held_rids(self) -> list[str]:
        return list(self.reqs)

    def busy(self) -> bool:
        """Requests held, or pages of ended ones still held while a prefill worker may write them."""
        return bool(self.reqs or self.prefill.draining)

    def flush_cache(self) -> bool:
        """Empty the radix cache (every cached page back to the pool; SGLang's ``flush_cache``), only
        while no request is held (``busy``): True when flushed, False (nothing changed) otherwise."""
        if self.busy():
            return False
        self.ledger.tree.reset()
        return True

    # ---- decode role: prompt KV from a prefill worker (``RemotePrefill`` has the details) -------
    def pop_kv_requests(self) -> list[Req]:
        return self.prefill.pop_requests()

    def waiting_for_kv(self, rid: str) -> Req | None:
        return self.prefill.get(rid)

    def kv_ready(self, rid: str, first_token_id: int, *received) -> StepOutput | None:
        """``RemotePrefill.kv_ready``: the first token, then what else the prefill worker sent."""
        return self.prefill.kv_ready(rid, first_token_id, *received)

    def kv_failed(self, rid: str, error: str, retryable: bool = False) -> StepOutput | None:
        return self.prefill.kv_failed(rid, error, retryable)

    def kv_drained(self, rid: str) -> None:
        self.prefill.kv_drained(rid)

    # ---- prefill role: KV handed on --------------------------------------------------------------
    def prefill_progress(self) -> list[tuple[Req, int]]:
        """Each prompt being computed in chunks, with its tokens whose KV is in the pool now."""
        return [(req, self.prefill.computed_tokens(req)) for req in self.prefill.prefilling]

    def pop_prefilled(self) -> list[Req]:
        """Requests whose first token is sampled (in ``output_ids``) and KV complete, since the last call."""
        return self.decode.pop()

    def prefill_sent(self, rid: str, ok: bool, error: str = "") -> None:
        """The KV write of a prefilled request ended: cache its pages (or free them) and forget it."""
        req = self.reqs.get(rid)
        if req is not None:
            self.reqs.end(req, FinishReason.STOP if ok else FinishReason.ERROR, error)

    # ---- the step -------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(len(self.queue) or self.prefill.runnable or self.decode.runnable or self.outstanding)

    def schedule(self) -> ScheduleBatch | None:
        """Pick this step's requests (decodes first, then prompt chunks within the token budget; under
        the priority policy, lower-priority running requests retracted first where ``Preemption`` says),
        build its forward batch and advance the requests' counters for it.

        Returns None when there is nothing to run, or when the step needs the token ids of the
        outstanding batch first (``needs_results``).
        """
        self.needs_results = False
        self.reqs.end_overdue()
        if any(b.verifies for b in self.outstanding):  # how many tokens it keeps moves every position
            self.needs_results = True
            return None
        preempted = self.preemption is None or self.preemption.run(in_flight=bool(self.outstanding))
        decodes = self.decode.schedule(in_flight=bool(self.outstanding)) if preempted else None
        if decodes is None:
            self.needs_results = True
            return None
        extends = self.prefill.schedule(self.config.chunked_prefill_size)
        self.metrics.set_load(self.load())
        if not extends[0] and not decodes[0]:
            if self.speculator is not None and not self.outstanding:
                self.speculator.idle()
            return None
        batch = ScheduleBatch(extends[0] + decodes[0], extends[1] + decodes[1], len(extends[0]))
        batch.set_drafts()
        batch, failed = prepare_batch(batch, self.runner, self.outstanding[-1] if self.outstanding else None)
        for req, error in failed:
            self.reqs.end_now(req, FinishReason.ERROR, error)
        if batch is not None:
            for req in batch.launch():  # a prompt whose last chunk runs goes on to the decode stage
                self.prefill.launched(req)
                self.decode.start(req)
            self.outstanding.append(batch)
        return batch

    def run_batch(self, batch: ScheduleBatch):
        """Run the forward of ``batch`` (thread-safe with respect to the request queues); returns its
        result. A forward that raises fails only the requests responsible (``batch_runner``)."""
        return run_batch(self.runner, batch).result

    def process_result(self, batch: ScheduleBatch, result=None) -> list[StepOutput]:
        """Apply the sampled tokens of ``batch`` (the oldest outstanding one); finish, hand on or
        keep each request."""
        if result is not None:
            batch.result = result
        self.outstanding.remove(batch)
        outputs = self.output.process(batch)
        self.ledger.slide_windows(batch.reqs, lambda req: kv_written(req, self.outstanding))
        self.metrics.set_load(self.load())
        return outputs

    def fail_batch(self, batch: ScheduleBatch, error: str) -> list[StepOutput]:
        """The whole step failed outside the forward: fail every request of ``batch``."""
        batch.row_errors = dict.fromkeys(range(len(batch.reqs)), error)
        return self.process_result(batch)

    def fail_all(self, error: str) -> list[StepOutput]:
        """End every request with ERROR ``error``, retryable (the scheduler is going down, to restart)."""
        return self.reqs.fail_all(error)

    def pop_aborted(self) -> list[StepOutput]:
        """Requests ended outside a step (explicit abort, deadline, queue time) since the last call."""
        return self.reqs.pop_aborted()

    def close(self) -> None:
        self.queue.grammars.close()  # its compiler process ends

    # ---- internals ------------------------------------------------------------------------------
    def _num_active(self) -> int:
        """Admitted requests not ended nor handed on (they count toward ``max_running_requests``)."""
        return self.prefill.num_active + self.decode.num_active

    def _leave(self, req: Req) -> bool:
        """Take an ending ``req`` out of the queue and both stages; True if the prefill stage holds
        its pages on (a prefill worker may still be writing them)."""
        self.queue.remove(req)
        self.decode.remove(req)
        return self.prefill.remove(req)

    # ---- state ----------------------------------------------------------------------------------
    def load(self) -> SchedulerLoad:
        kv, limits = self.ledger, (self.usable_pages, self.page_size, self.request_capacity, self.queue.bound)
        pages = (kv.used_pages(), kv.free_pages(), kv.cached_pages())
        return SchedulerLoad(self._num_active(), len(self.queue), *pages, *limits, kv.lora_resident())

    def check_invariants(self) -> None:
        """Raise AssertionError if KV pages are not conserved."""
        self.ledger.check_conservation(self.usable_pages)

    def state_digest(self) -> str:
        """A hash of the scheduling state every TP rank must hold identically (``digest.state_digest``)."""
        return state_digest((self.queue.waiting, *self.prefill.queues(), *self.decode.queues()), self.ledger)
