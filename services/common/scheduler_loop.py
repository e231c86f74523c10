"""Drive a ``Scheduler`` from an asyncio loop: inputs → schedule → forward on a worker thread → process.

The event loop thread owns all scheduler state; only the forward runs on the single worker thread,
so gRPC handlers (add, abort) never race with scheduling decisions: they submit events that enter
the scheduler at one point per iteration (``collect_inputs``, ``pdserve.services.common.step_inputs``).
Under tensor parallelism that point is where rank 0's inputs reach every rank, so all ranks apply
the same events in the same order and run the same steps; only rank 0 emits outputs. A failed
forward or collective there fails the whole rank group (the loop raises): a rank that skipped a
step could never meet the others in their collectives again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdserve.distributed import SINGLE_RANK, TpGroup
from pdserve.scheduler.overload import QueueFull
from pdserve.scheduler.req import FinishReason
from pdserve.scheduler.scheduler import Scheduler, StepOutput
from pdserve.services.common.liveness import Heartbeat
from pdserve.services.common.step_inputs import Abort, InputSync, NewRequest, StepInputs

logger = logging.getLogger(__name__)

Handler = Callable[[Any], "list[StepOutput] | None | Awaitable[list[StepOutput] | None]"]
IDLE_POLL_S = 0.05  # how often an idle loop wakes to check deadlines (and, under TP, meet its ranks)


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
            function of the event returning the outputs it produced (a list, None, or an awaitable
            of either); ``NewRequest`` and ``Abort`` go to the scheduler unless overridden.
        tp: this rank's TP group.

    Attributes:
        inputs: where handlers submit events (``InputSync``).
        heartbeat: beaten once per iteration (the worker's liveness, see ``liveness.StepWatchdog``).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        on_outputs: Callable[[list[StepOutput]], None],
        after_schedule: Callable[[], None] | None = None,
        handlers: dict[type, Handler] | None = None,
        tp: TpGroup = SINGLE_RANK,
    ) -> None:
        self.scheduler = scheduler
        self.on_outputs = on_outputs if tp.is_driver else lambda outputs: None
        self.handlers: dict[type, Handler] = {NewRequest: self.add, Abort: self._abort, **(handlers or {})}
        self.after_schedule = after_schedule or (lambda: None)
        self.tp = tp
        self.inputs = InputSync(tp)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._wakeup = asyncio.Event()
        self.heartbeat = Heartbeat()
        self._digest: str | None = None
        if tp.size > 1:
            self._now = 0.0
            scheduler.clock = lambda: self._now  # rank 0's reading of this step, on every rank

    def add(self, event: NewRequest) -> list[StepOutput]:
        """Queue the request; one the scheduler refuses (its handler checked it, so only a state that
        changed meanwhile can: a queue grown by retractions is retryable) ends at once with an error
        output instead of failing the loop."""
        try:
            self.scheduler.add_request(event.req)
        except (ValueError, QueueFull) as e:
            event.req.retryable = isinstance(e, QueueFull)
            event.req.finish(FinishReason.ERROR, str(e))
            return [StepOutput(event.req, finished=True)]
        return []

    def _abort(self, event: Abort) -> None:
        self.scheduler.abort_request(event.rid, event.reason)

    async def apply_inputs(self, inputs: StepInputs) -> list[StepOutput]:
        """Apply the iteration's events in order; the outputs they produced."""
        outputs: list[StepOutput] = []
        for event in inputs.events:
            produced = self.handlers[type(event)](event)
            if inspect.isawaitable(produced):
                produced = await produced
            outputs += produced or []
        return outputs

    def wake(self) -> None:
        """Call after submitting an event so an idle loop takes it at once."""
        self._wakeup.set()

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

    async def run(self, stop: asyncio.Event) -> None:
        """Raises ``TpGroupFailure`` (TP only) when the group cannot go on."""
        loop = asyncio.get_running_loop()
        sched = self.scheduler
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
                batch = sched.schedule()
                self.after_schedule()
                outputs = sched.pop_aborted()
                if batch is not None:
                    try:
                        result = await loop.run_in_executor(self.executor, sched.run_batch, batch)
                    except Exception as e:
                        if self.tp.size > 1:
                            raise TpGroupFailure(f"forward failed on TP rank {self.tp.rank}: {e}") from e
                        logger.exception("forward failed")  # fails its requests, not the service
                        outputs += sched.fail_batch(batch, f"forward failed: {e}")
                    else:
                        outputs += sched.process_result(batch, result)
                if self.tp.size > 1:
                    self._digest = sched.state_digest()
                if outputs:
                    self.on_outputs(outputs)
                if batch is None and self.tp.is_driver:
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), IDLE_POLL_S)
                    except TimeoutError:
                        pass
                else:
                    await asyncio.sleep(0)  # let gRPC handlers run between steps
        finally:
            self.inputs.close()
            self.executor.shutdown(wait=False, cancel_futures=True)
