"""Drive a ``Scheduler`` from an asyncio loop: schedule → forward on a worker thread → process.

The event loop thread owns all scheduler state; only the forward runs on the single worker thread,
so gRPC handlers (add, abort) never race with scheduling decisions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pdserve.scheduler.scheduler import Scheduler, StepOutput
from pdserve.services.common.liveness import Heartbeat

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how often an idle loop wakes to check deadlines


class SchedulerLoop:
    """Runs ``scheduler`` until ``stop`` is set.

    Args:
        scheduler: the transport-free scheduler.
        on_outputs: called on the loop thread with every step's outputs (tokens, finishes, aborts).
        after_schedule: called after each ``schedule()`` (the decode role starts prefill calls there,
            the prefill role starts KV writes).

    Attributes:
        heartbeat: beaten once per iteration (the worker's liveness, see ``liveness.StepWatchdog``).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        on_outputs: Callable[[list[StepOutput]], None],
        after_schedule: Callable[[], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.on_outputs = on_outputs
        self.after_schedule = after_schedule or (lambda: None)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._wakeup = asyncio.Event()
        self.heartbeat = Heartbeat()

    def wake(self) -> None:
        """Call after adding or aborting a request so an idle loop schedules at once."""
        self._wakeup.set()

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        while not stop.is_set():
            self.heartbeat.beat()
            self._wakeup.clear()
            batch = sched.schedule()
            self.after_schedule()
            outputs = sched.pop_aborted()
            if batch is not None:
                try:
                    result = await loop.run_in_executor(self.executor, sched.run_batch, batch)
                except Exception as e:  # a failed forward fails its requests, not the service
                    logger.exception("forward failed")
                    outputs += sched.fail_batch(batch, f"forward failed: {e}")
                else:
                    outputs += sched.process_result(batch, result)
            if outputs:
                self.on_outputs(outputs)
            if batch is None:
                try:
                    await asyncio.wait_for(self._wakeup.wait(), IDLE_POLL_S)
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)  # let gRPC handlers run between steps
        self.executor.shutdown(wait=False, cancel_futures=True)
