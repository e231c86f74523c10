"""Drive a ``Scheduler`` from an asyncio loop, overlapping each step's CPU work with the next forward.

The event loop thread owns all scheduler state; only forwards run, one after another, on the single
forward thread. With overlap (the default; SGLang's ``event_loop_overlap``), while the forward of
step N runs the loop thread processes step N-1's results, sends them, takes new requests and aborts,
and schedules step N+1, whose decode inputs are step N's sampled ids, filled in on the forward
thread (``ScheduleBatch.resolve``). Without overlap (``--disable-overlap-schedule``) every step is
schedule → forward → process.

One iteration:

    1. inputs   apply this step's inputs, in the order they arrived (the seam below)
    2. schedule step N+1 (if it needs step N's token ids first: process step N, then schedule)
    3. launch   queue step N+1 on the forward thread (it starts when step N's forward ends)
    4. process  await step N's result, apply it (without overlap: step N+1's, right away)
    5. emit     hand the step's outputs (tokens, finishes, aborts, failures) to ``on_outputs``

The step-input seam: gRPC handlers never touch the scheduler. They submit *events* (:meth:`add`,
:meth:`abort`, :meth:`call`, or a role's own events through ``inputs``), and step 1 applies every
event at one point per iteration, in arrival order, before scheduling
(``pdserve.services.common.step_inputs``). Under tensor parallelism that point is where rank 0's
events reach every rank (one all-gather over the gloo control group, with rank 0's clock reading
and each rank's reports and state digest), so every rank applies the same list there and runs the
same steps; only rank 0 emits outputs. Collectives stay in the same order on every rank: the
exchange is the only control-group collective, once per iteration at step 1, and the forwards
(whose all-reduces use the device group) run one after another on the forward thread, the same
batches in the same order. A failed collective, or states that diverged, fail the whole rank group
(the loop raises): a rank that skipped a step could never meet the others in their collectives again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import threadpoolctl
import torch

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.scheduler.overload import QueueFull
from pdserve.scheduler.req import FinishReason, Req
from pdserve.scheduler.schedule_batch import ScheduleBatch
from pdserve.scheduler.scheduler import DuplicateRid, Scheduler, StepOutput
from pdserve.services.common.liveness import Heartbeat
from pdserve.services.common.step_inputs import Abort, InputSync, NewRequest, StepInputs

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


@dataclass(slots=True)
class Call:
    """``fn(scheduler, *args)`` at the seam; ``fn`` is a module-level function or a ``Scheduler``
    method (it travels to every rank by name)."""

    fn: Callable[..., Any]
    args: tuple


def refusal_status(error: ValueError | QueueFull) -> grpc.StatusCode:
    """The status a servicer answers for a request ``SchedulerLoop.add`` refused: ALREADY_EXISTS for a
    rid the scheduler holds (``DuplicateRid``), RESOURCE_EXHAUSTED (the gateway's 429) for a full
    queue, INVALID_ARGUMENT for any other ValueError."""
    if isinstance(error, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return (
        grpc.StatusCode.ALREADY_EXISTS
        if isinstance(error, DuplicateRid)
        else grpc.StatusCode.INVALID_ARGUMENT
    )


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

    Attributes:
        inputs: where handlers submit events (``InputSync``).
        heartbeat: beaten once per iteration (the worker's liveness, see ``liveness.StepWatchdog``).
            Every iteration awaits the forward it launched one iteration earlier (at once without
            overlap), so a forward that never returns stops the beats within one iteration.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        on_outputs: Callable[[list[StepOutput]], None],
        after_schedule: Callable[[], None] | None = None,
        handlers: dict[type, Handler] | None = None,
        tp: TpGroup = SINGLE_RANK,
        overlap: bool = True,
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
        self.inputs = InputSync(tp)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._wakeup = asyncio.Event()
        self.heartbeat = Heartbeat()
        self._digest: str | None = None
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
        self.scheduler.add_request(event.req)
        return len(self.scheduler.waiting)

    def _abort(self, event: Abort) -> bool:
        return self.scheduler.abort_request(event.rid, event.reason, event.finish_reason)

    def _call(self, event: Call) -> Any:
        return event.fn(self.scheduler, *event.args)

    async def apply_inputs(self, inputs: StepInputs) -> list[StepOutput]:
        """Step 1: apply the iteration's events in order; the outputs they produced."""
        outputs: list[StepOutput] = []
        for event, done in zip(inputs.events, inputs.done, strict=True):
            try:
                value = self.handlers[type(event)](event)
                if inspect.isawaitable(value):
                    value = await value
            except Exception as e:
                if done is not None:
                    if not done.done():
                        done.set_exception(e)
                elif self.tp.is_driver:
                    logger.exception("step input %s failed", type(event).__name__)
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

    # ---- the loop -------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Run the loop on this thread, without an OpenMP team (:func:`openmp_off_this_thread`).

        Raises:
            TpGroupFailure: (TP only) the rank group cannot go on.
        """
        with openmp_off_this_thread():
            await self._run(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        sched = self.scheduler
        in_flight: tuple[ScheduleBatch, asyncio.Future] | None = None
        try:
            while True:
                self.heartbeat.beat()
                self._wakeup.clear()
                inputs = await self.collect_inputs(stop)
                if inputs.stop:
                    break
                applied = await self.apply_inputs(inputs)
                if applied:  # sent before the step's: one output batch holds a rid once
                    self.on_outputs(applied)
                outputs: list[StepOutput] = []
                batch = sched.schedule()
                if batch is None and sched.needs_results and in_flight is not None:
                    outputs += await self._process(*in_flight)
                    in_flight = None
                    batch = sched.schedule()
                self.after_schedule()
                launched = None if batch is None else (batch, self._launch(batch))
                if in_flight is not None:  # step N's results while step N+1 runs
                    outputs += await self._process(*in_flight)
                in_flight = launched
                if in_flight is not None and not self.overlap:
                    outputs += await self._process(*in_flight)
                    in_flight = None
                outputs += sched.pop_aborted()
                if self.tp.size > 1:
                    self._digest = sched.state_digest()
                if outputs:
                    self.on_outputs(outputs)
                idle = batch is None and in_flight is None and not self.inputs.pending()
                if idle and self.tp.is_driver:  # the other ranks wait in the next exchange
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), IDLE_POLL_S)
                    except TimeoutError:
                        pass
                elif not self.overlap or in_flight is None:
                    await asyncio.sleep(0)  # let gRPC handlers run between steps
        except asyncio.CancelledError:  # (``supervise``: the TP group failed, the process exits)
            in_flight = None  # its forward may wait on a hung rank's collective until gloo's 60 s timeout
            raise
        finally:
            if in_flight is not None:  # let the last forward end before the executor goes
                await asyncio.wait([in_flight[1]])
            self.inputs.close()
            self.executor.shutdown(wait=False, cancel_futures=True)
            sched.grammar_queue.close()

    def _launch(self, batch: ScheduleBatch) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.executor, self.scheduler.run_batch, batch)

    async def _process(self, batch: ScheduleBatch, future: asyncio.Future) -> list[StepOutput]:
        try:
            result = await future
        except Exception as e:  # run_batch isolates forward errors; anything else fails the step
            if self.tp.size > 1:
                raise TpGroupFailure(f"step failed on TP rank {self.tp.rank}: {e}") from e
            logger.exception("step failed")
            return self.scheduler.fail_batch(batch, f"step failed: {type(e).__name__}: {e}")
        return self.scheduler.process_result(batch, result)
