"""Drive a ``Scheduler`` from an asyncio loop, overlapping each step's CPU work with the next forward.

The event loop thread owns all scheduler state; only forwards run, one after another, on the single
forward thread. Two loops, one iteration each:

    normal_loop   (SGLang's ``event_loop_normal``; the default on a CPU whose every core the forward
                   takes, see ``bootstrap.overlap_schedule``)
        take_inputs → schedule step N → launch it → process its result → emit
    overlap_loop  (SGLang's ``event_loop_overlap``; the default elsewhere)
        take_inputs → schedule step N+1 → launch it → process step N's result → emit

With overlap, while the forward of step N+1 runs the loop thread processes step N's results, sends
them, and takes new requests and aborts; step N+1's decode inputs are step N's sampled ids, filled
in on the forward thread (``ScheduleBatch.resolve``). A step that needs step N's token ids first
(``Scheduler.needs_results``) processes step N before it schedules again.

The step-input seam: gRPC handlers never touch the scheduler. They submit *events* (:meth:`add`,
:meth:`abort`, :meth:`call`, or a role's own events, every type defined in ``events``), and
``take_inputs`` applies every event at one point per iteration, in arrival order, before scheduling
(``pdserve.services.common.step_inputs``). Under tensor parallelism that point is where rank 0's
events reach every rank (one all-gather over the gloo control group, with rank 0's clock reading
and each rank's reports and state digest), so every rank applies the same list there and runs the
same steps; only rank 0 emits outputs. Collectives stay in the same order on every rank: the
exchange is the only control-group collective, once per iteration, and the forwards (whose
all-reduces use the device group) run one after another on the forward thread, the same batches in
the same order. A failed collective, or states that diverged, fail the whole rank group (the loop
raises): a rank that skipped a step could never meet the others in their collectives again.

An event whose handler raises answers its future with the exception; an event of one request (it
has a ``rid``: KVReady, KVWritten, ...) also fails that request (ERROR, its pages released), since
its poster may await nothing (a prefill task's KVReady) and the request would wait for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import threadpoolctl
import torch

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.mem_cache.kv_events import KVEventPublisher
from pdserve.scheduler.req import FinishReason, Req
from pdserve.scheduler.schedule_batch import ScheduleBatch, StepOutput
from pdserve.scheduler.scheduler import Scheduler
from pdserve.services.common.events import Abort, Call, NewRequest
from pdserve.services.common.forward_lock import ForwardLock
from pdserve.services.common.liveness import Heartbeat
from pdserve.services.common.step_inputs import InputSync, StepInputs

logger = logging.getLogger(__name__)

Handler = Callable[[Any], Any]
IDLE_POLL_S = 0.05  # how often an idle loop wakes to check deadlines (and, under TP, meet its ranks)


def openmp_off_this_thread() -> threadpoolctl.threadpool_limits:
    """A context in which the calling thread runs its torch ops alone, never with an OpenMP team.

    The forward thread owns the process's OpenMP team (its threads are the cores the model runs
    on). The loop thread's own torch ops are small (a step's positions, page-table rows, results),
    but some open a parallel region whatever their size (``repeat_interleave`` has a grain of 1),
    and the first one gives the loop thread a team of its own whose helpers live as long as it
    does. libgomp then counts more OpenMP threads than cores and from then on lets the forward
    team's helpers spin only briefly before sleeping: every barrier of every forward pays a futex
    wake-up. Measured on a 2-core Zen 5, in-process, tiny model, 512 requests at concurrency 64:
    9.1-10.9k -> 15.6-16.8k tok/s, 41k -> 0.6k voluntary context switches. (A thread that already
    has a team keeps its helpers: enter this before the thread's first parallel region.)

    libgomp keeps the thread count per thread (``omp_set_num_threads`` sets the calling thread's
    ICV, which torch's ``parallel_for`` reads), so the forward thread keeps its team. torch's
    per-thread lazy initialisation runs first (``torch.get_num_threads``), else it would reset the
    count later. Leaving the context restores the thread's count.
    """
    torch.get_num_threads()
    return threadpoolctl.threadpool_limits(limits=1, user_api="openmp")


class TpGroupFailure(RuntimeError):
    """The ranks of a tensor-parallel scheduler can no longer run in step (a rank died, hung, failed
    a forward, or their states diverged); the whole group must restart."""


class SchedulerLoop:
    """Runs ``scheduler`` until ``stop`` is set (on rank 0; the other ranks follow rank 0's stop).

    Args:
        scheduler: the transport-free scheduler.
        on_outputs: called on the loop thread with every step's outputs (tokens, finishes, aborts);
            rank 0 only.
        after_schedule: called after each ``schedule()`` (the decode role starts prefill calls there,
            the prefill role starts KV writes).
        handlers: how the role applies each kind of event (on every rank, in the inputs' order): a
            function of the event returning a value (a ``StepOutput`` or a list of them goes out
            with the step's outputs; the value, or what it raised, answers the event's ``done``
            future on rank 0), possibly awaitable; ``NewRequest`` and ``Abort`` go to the scheduler
            unless overridden.
        tp: this rank's TP group.
        overlap: overlap each step's CPU work with the next forward (see the module docstring).
        forward_lock: the turn each forward takes among schedulers sharing a CPU's cores
            (``--forward-lock``); None: forwards run whenever they come.

    Attributes:
        inputs: where handlers submit events (``InputSync``).
        heartbeat: beaten once per iteration (the worker's liveness, see ``liveness.StepWatchdog``).
            Every iteration awaits the forward it launched one iteration earlier (at once without
            overlap), so a forward that never returns stops the beats within one iteration.
        kv_events: (rank 0) the radix cache's KV events, one batch per iteration (flushed in
            ``emit``); None on the other ranks. Subscribers run on this loop's thread.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        on_outputs: Callable[[list[StepOutput]], None],
        after_schedule: Callable[[], None] | None = None,
        handlers: dict[type, Handler] | None = None,
        tp: TpGroup = SINGLE_RANK,
        overlap: bool = True,
        forward_lock: ForwardLock | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.on_outputs = on_outputs if tp.is_driver else lambda outputs: None
        self.handlers: dict[type, Handler] = {
            NewRequest: self.add_request,
            Abort: self._abort,
            Call: self._call,
            **(handlers or {}),
        }
        self.after_schedule = after_schedule or (lambda: None)
        self.tp = tp
        self.overlap = overlap
        self.forward_lock = forward_lock
        self.inputs = InputSync(tp)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._wakeup = asyncio.Event()
        self.heartbeat = Heartbeat()
        self.kv_events: KVEventPublisher | None = None
        if tp.is_driver:
            tree = scheduler.ledger.tree
            self.kv_events = KVEventPublisher(tree.snapshot_events)
            tree.set_event_sink(self.kv_events.record)
        self._digest: str | None = None
        self._in_flight: tuple[ScheduleBatch, asyncio.Future] | None = (
            None  # overlap: launched, not processed
        )
        if tp.size > 1:
            self._now = 0.0
            scheduler.clock = lambda: self._now  # rank 0's reading of this step, on every rank

    # ---- step inputs (rank 0's handlers, on the loop's thread) ------------------------------
    def add(self, req: Req) -> asyncio.Future:
        """Queue ``req`` at the next step; the future gets its queue position, or the ValueError /
        QueueFull with which ``Scheduler.add_request`` refused it (``refusal_status`` maps them)."""
        return self.submit(NewRequest(req))

    def abort(self, rid: str, reason: str, finish_reason: FinishReason = FinishReason.ABORT) -> None:
        """Abort ``rid`` at the next step (whatever state it is in; unknown rids are ignored); it
        counts as ended by ``finish_reason``."""
        self.submit(Abort(rid, reason, finish_reason))

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Apply ``fn(scheduler, *args)`` at the next step's input point (see :class:`Call`)."""
        return self.submit(Call(fn, args))

    def submit(self, event: Any) -> asyncio.Future:
        """Submit ``event`` for the next step and wake the loop; the future gets what its handler
        returned (or raised)."""
        done = asyncio.get_running_loop().create_future()
        self.inputs.submit(event, done)
        self._wakeup.set()
        return done

    def wake(self) -> None:
        """Wake an idle loop (after submitting an event, or changing what ``after_schedule`` finds)."""
        self._wakeup.set()

    # ---- default handlers (every rank) ------------------------------------------------------
    def add_request(self, event: NewRequest) -> int:
        """``Scheduler.add_request``; the queue position (raises as it does)."""
        return self.scheduler.add_request(event.req)

    def _abort(self, event: Abort) -> bool:
        return self.scheduler.abort_request(event.rid, event.reason, event.finish_reason)

    def _call(self, event: Call) -> Any:
        return event.fn(self.scheduler, *event.args)

    async def apply_inputs(self, inputs: StepInputs) -> list[StepOutput]:
        """Apply the iteration's events in order (``take_inputs``); the outputs they produced."""
        outputs: list[StepOutput] = []
        for event, done in zip(inputs.events, inputs.done, strict=True):
            try:
                value = self.handlers[type(event)](event)
                if inspect.isawaitable(value):
                    value = await value
            except Exception as e:
                if done is not None and not done.done():
                    done.set_exception(e)
                rid = getattr(event, "rid", None)
                if (done is None or rid is not None) and self.tp.is_driver:
                    logger.exception("step input %s failed", type(event).__name__, extra={"rid": rid})
                if rid is not None:  # logged, and its request fails: a poster that awaits nothing is fine
                    error = f"internal error applying {type(event).__name__}: {type(e).__name__}: {e}"
                    self.scheduler.abort_request(rid, error, FinishReason.ERROR)
                    if done is not None:
                        done.exception()  # (marks it retrieved; a poster that awaits still gets it)
                continue
            if isinstance(value, StepOutput):
                outputs.append(value)
            elif isinstance(value, list):
                outputs.extend(value)
            if done is not None and not done.done():
                done.set_result(value)
        return outputs

    async def collect_inputs(self, stop: asyncio.Event) -> StepInputs:
        """The iteration's inputs: rank 0's events (and every rank's reports), the same on every rank.

        Raises:
            TpGroupFailure: a peer rank is gone, or the ranks' states diverged.
        """
        try:
            inputs = await self.inputs.exchange(stop.is_set(), self._digest)
        except RuntimeError as e:
            raise TpGroupFailure(f"TP rank group broke: {e}") from e
        if len(set(inputs.digests)) > 1:
            raise TpGroupFailure(f"TP ranks' scheduler states diverged: {inputs.digests}")
        if self.tp.size > 1:
            self._now = inputs.now
            if inputs.digests[0] is not None:
                self.scheduler.metrics.tp_state_checks.inc()
        return inputs

    # ---- the loops ----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Run ``overlap_loop`` (or ``normal_loop``) on this thread, without an OpenMP team
        (:func:`openmp_off_this_thread`), until ``stop``.

        Raises:
            TpGroupFailure: (TP only) the rank group cannot go on.
        """
        with openmp_off_this_thread():
            try:
                await (self.overlap_loop(stop) if self.overlap else self.normal_loop(stop))
            except asyncio.CancelledError:  # (``supervise``: the TP group failed, the process exits)
                self._in_flight = None  # its forward may wait on a hung rank's collective (gloo's 60 s)
                raise
            finally:
                if self._in_flight is not None:  # let the last forward end before the executor goes
                    await asyncio.wait([self._in_flight[1]])
                self.inputs.close()
                if self.kv_events is not None:
                    self.kv_events.close()
                self.executor.shutdown(wait=False, cancel_futures=True)
                self.scheduler.close()
                if self.forward_lock is not None:
                    self.forward_lock.close()

    async def normal_loop(self, stop: asyncio.Event) -> None:
        """One step at a time: schedule step N, run it, process its result."""
        while await self.take_inputs(stop):
            batch = self.schedule()
            outputs = [] if batch is None else await self.process(batch, self.launch(batch))
            self.emit(outputs)
            await self.pause(idle=batch is None)

    async def overlap_loop(self, stop: asyncio.Event) -> None:
        """Step N+1 is scheduled and launched while step N's forward runs; then step N's result is
        processed (its forward ends before step N+1's starts, on the one forward thread)."""
        while await self.take_inputs(stop):
            outputs: list[StepOutput] = []
            batch = self.scheduler.schedule()
            if batch is None and self.scheduler.needs_results and self._in_flight is not None:
                outputs += await self.process(*self._in_flight)  # step N's token ids come first
                self._in_flight = None
                batch = self.scheduler.schedule()
            self.after_schedule()
            launched = None if batch is None else (batch, self.launch(batch))
            if self._in_flight is not None:
                outputs += await self.process(*self._in_flight)
            self._in_flight = launched
            self.emit(outputs)
            await self.pause(idle=batch is None)

    # ---- the steps of an iteration ------------------------------------------------------------
    async def take_inputs(self, stop: asyncio.Event) -> bool:
        """Beat the heartbeat, exchange and apply the iteration's inputs (and send the outputs they
        made: before the step's, so that one output batch holds a rid once). False once stopping."""
        self.heartbeat.beat()
        self._wakeup.clear()
        inputs = await self.collect_inputs(stop)
        if inputs.stop:
            return False
        applied = await self.apply_inputs(inputs)
        if applied:
            self.on_outputs(applied)
        return True

    def schedule(self) -> ScheduleBatch | None:
        """The next step's batch (None: nothing to run); then the role's ``after_schedule``."""
        batch = self.scheduler.schedule()
        self.after_schedule()
        return batch

    def launch(self, batch: ScheduleBatch) -> asyncio.Future:
        """Queue ``batch``'s forward on the forward thread (it starts when the one before it ends)."""
        return asyncio.get_running_loop().run_in_executor(self.executor, self._forward, batch)

    def _forward(self, batch: ScheduleBatch):
        """(forward thread) ``batch``'s forward, in this scheduler's turn when it has a forward lock."""
        with self.forward_lock.turn() if self.forward_lock else contextlib.nullcontext():
            return self.scheduler.run_batch(batch)

    async def process(self, batch: ScheduleBatch, forward: asyncio.Future) -> list[StepOutput]:
        """Await ``batch``'s forward and apply its result; a step that failed outside the forward fails
        its requests (under TP: the group, ``TpGroupFailure``)."""
        try:
            result = await forward
        except Exception as e:  # run_batch isolates forward errors; anything else fails the step
            if self.tp.size > 1:
                raise TpGroupFailure(f"step failed on TP rank {self.tp.rank}: {e}") from e
            logger.exception("step failed")
            return self.scheduler.fail_batch(batch, f"step failed: {type(e).__name__}: {e}")
        return self.scheduler.process_result(batch, result)

    def emit(self, outputs: list[StepOutput]) -> None:
        """Hand the step's outputs, and those of requests ended outside it, to ``on_outputs``; under
        TP, take this rank's state digest for the next exchange; send the iteration's KV events."""
        outputs += self.scheduler.pop_aborted()
        if self.kv_events is not None:
            self.kv_events.flush()
        if self.tp.size > 1:
            self._digest = self.scheduler.state_digest()
        if outputs:
            self.on_outputs(outputs)

    async def pause(self, idle: bool) -> None:
        """Between iterations. Idle (nothing scheduled, no input waiting), rank 0 waits for a wake-up
        or ``IDLE_POLL_S`` (deadlines; the other ranks wait in the next exchange); otherwise gRPC
        handlers get a turn, unless a forward is in flight (awaiting its result yields anyway)."""
        if idle and self.tp.is_driver and not self.inputs.pending():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), IDLE_POLL_S)
        elif self._in_flight is None:
            await asyncio.sleep(0)
