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

The step-input seam: gRPC handlers never touch the scheduler. They put *inputs* into the loop's
inbox (:meth:`add`, :meth:`abort`, :meth:`call`), and step 1 applies everything in the inbox at one
point per iteration, in arrival order, before scheduling. That is the only place where anything but
the loop changes what the scheduler schedules, so a tensor-parallel group stays in lockstep when rank
0 broadcasts the list of inputs it applies at step 1 and every rank applies the same list there.
(Deadline expiry reads the clock inside ``schedule()``; a TP group must turn it into aborts at the
seam on rank 0.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdserve.scheduler.req import Req
from pdserve.scheduler.schedule_batch import ScheduleBatch
from pdserve.scheduler.scheduler import Scheduler, StepOutput
from pdserve.services.common.liveness import Heartbeat

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how often an idle loop wakes to check deadlines


@dataclass(slots=True)
class StepInput:
    """One input of a step: ``fn(scheduler, *args)`` applied at the seam; its return value (a
    ``StepOutput`` or a list of them, or None) goes out with the step's outputs, and ``done`` (if
    any) gets the value, or the exception ``fn`` raised."""

    fn: Callable[..., Any]
    args: tuple
    done: asyncio.Future | None = None


def _add_request(scheduler: Scheduler, req: Req) -> int:
    scheduler.add_request(req)
    return len(scheduler.waiting)


def _abort_request(scheduler: Scheduler, rid: str, reason: str) -> bool:
    return scheduler.abort_request(rid, reason)


class SchedulerLoop:
    """Runs ``scheduler`` until ``stop`` is set.

    Args:
        scheduler: the transport-free scheduler.
        on_outputs: called on the loop thread with every step's outputs (tokens, finishes, aborts).
        after_schedule: called after each ``schedule()`` (the decode role starts prefill calls there,
            the prefill role starts KV writes).
        overlap: overlap each step's CPU work with the next forward (see the module docstring).

    Attributes:
        heartbeat: beaten once per iteration (the worker's liveness, see ``liveness.StepWatchdog``).
            Every iteration awaits the forward it launched one iteration earlier (at once without
            overlap), so a forward that never returns stops the beats within one iteration.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        on_outputs: Callable[[list[StepOutput]], None],
        after_schedule: Callable[[], None] | None = None,
        overlap: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.on_outputs = on_outputs
        self.after_schedule = after_schedule or (lambda: None)
        self.overlap = overlap
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._wakeup = asyncio.Event()
        self._inbox: list[StepInput] = []
        self.heartbeat = Heartbeat()

    # ---- step inputs (any coroutine of the loop's thread) -----------------------------------
    def add(self, req: Req) -> asyncio.Future:
        """Queue ``req`` for the next step; the future gets its queue position, or the ValueError
        with which ``Scheduler.add_request`` refused it."""
        done = asyncio.get_running_loop().create_future()
        self.call(_add_request, req, done=done)
        return done

    def abort(self, rid: str, reason: str) -> None:
        """Abort ``rid`` at the next step (whatever state it is in; unknown rids are ignored)."""
        self.call(_abort_request, rid, reason)

    def call(self, fn: Callable[..., Any], *args: Any, done: asyncio.Future | None = None) -> None:
        """Apply ``fn(scheduler, *args)`` at the next step's input point (see :class:`StepInput`)."""
        self._inbox.append(StepInput(fn, args, done))
        self._wakeup.set()

    def wake(self) -> None:
        """Wake an idle loop (e.g. after changing what ``after_schedule`` will find)."""
        self._wakeup.set()

    def _apply_inputs(self) -> list[StepOutput]:
        """Step 1: every input queued since the last step, in arrival order."""
        inputs, self._inbox = self._inbox, []
        outputs: list[StepOutput] = []
        for item in inputs:
            try:
                value = item.fn(self.scheduler, *item.args)
            except Exception as e:
                if item.done is None:
                    logger.exception("step input %s failed", item.fn.__name__)
                elif not item.done.done():
                    item.done.set_exception(e)
                continue
            if isinstance(value, StepOutput):
                outputs.append(value)
            elif isinstance(value, list):
                outputs.extend(value)
            if item.done is not None and not item.done.done():
                item.done.set_result(value)
        return outputs

    # ---- the loop -------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        sched = self.scheduler
        in_flight: tuple[ScheduleBatch, asyncio.Future] | None = None
        try:
            while not stop.is_set():
                self.heartbeat.beat()
                self._wakeup.clear()
                outputs = self._apply_inputs()
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
                if outputs:
                    self.on_outputs(outputs)
                if batch is None and in_flight is None and not self._inbox:
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), IDLE_POLL_S)
                    except TimeoutError:
                        pass
                elif not self.overlap or in_flight is None:
                    await asyncio.sleep(0)  # let gRPC handlers run between steps
        finally:
            if in_flight is not None:  # let the last forward end before the executor goes
                await asyncio.wait([in_flight[1]])
            self.executor.shutdown(wait=False, cancel_futures=True)

    def _launch(self, batch: ScheduleBatch) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.executor, self.scheduler.run_batch, batch)

    async def _process(self, batch: ScheduleBatch, future: asyncio.Future) -> list[StepOutput]:
        try:
            result = await future
        except Exception as e:  # run_batch isolates forward errors; anything else fails the step
            logger.exception("step failed")
            return self.scheduler.fail_batch(batch, f"step failed: {type(e).__name__}: {e}")
        return self.scheduler.process_result(batch, result)
