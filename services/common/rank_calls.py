"""Rank 0 asks every rank of its TP group to do something at the step seam, and awaits each answer.

A decode worker's NIXL work is per rank (each rank has its own agent and pool shard), but only rank 0
talks to prefill workers. When rank 0 needs every rank's part (describe its agent, load the worker's
rank ``i`` agent, expect a transfer), it
``call``s: the call enters every rank as an event at the step seam (``step_inputs``), each rank runs
the named function there and reports its result, and rank 0's call returns the results in rank
order once every rank's report reached it (one or two loop iterations); ``broadcast`` does not wait
for results. A function that raises on a rank makes the call raise that exception (the lowest such
rank's). With one rank the function runs at once, in the caller.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.services.common.events import RankCall, RankResult
from pdserve.services.common.scheduler_loop import SchedulerLoop

logger = logging.getLogger(__name__)


class RankCalls:
    """Calls from rank 0 to every rank of ``loop``'s TP group.

    Args:
        loop: the rank's scheduler loop (its handlers learn ``RankCall`` and ``RankResult``).
        functions: what may be called, by name; each returns a picklable result on every rank and
            must decide only from state every rank holds identically, plus its own rank's NIXL agent.
    """

    def __init__(self, loop: SchedulerLoop, functions: dict[str, Callable[..., Any]]) -> None:
        self.loop = loop
        self.tp = loop.tp
        self.functions = functions
        self._ids = itertools.count()
        self._pending: dict[int, tuple[asyncio.Future, dict[int, Any]]] = {}
        loop.handlers[RankCall] = self._run
        loop.handlers[RankResult] = self._collect

    async def call(self, name: str, *args: Any) -> list[Any]:
        """Every rank's result of ``functions[name](*args)``, in rank order (rank 0 only).

        Raises:
            Exception: what the function raised on the lowest rank where it raised.
        """
        if self.tp.size == 1:
            return [self.functions[name](*args)]
        call_id = next(self._ids)
        done = asyncio.get_running_loop().create_future()
        self._pending[call_id] = (done, {})
        self.loop.inputs.submit(RankCall(call_id, name, args))
        self.loop.wake()
        try:
            results = await done
        finally:
            self._pending.pop(call_id, None)
        for result in results:
            if isinstance(result, _Raised):
                raise result.exception()
        return results

    def broadcast(self, name: str, *args: Any) -> None:
        """Run ``functions[name](*args)`` on every rank at the next seam (at once with one rank)."""
        if self.tp.size == 1:
            self.functions[name](*args)
            return
        self.loop.inputs.submit(RankCall(-1, name, args))
        self.loop.wake()

    def _run(self, event: RankCall) -> None:
        try:
            result = self.functions[event.name](*event.args)
        except Exception as e:
            if event.call_id < 0:  # its own agent's side effect only: the ranks stay in step
                logger.exception("TP rank %d: %s failed", self.tp.rank, event.name)
                return
            result = _Raised(type(e), f"TP rank {self.tp.rank}: {e}")
        if event.call_id >= 0:
            self.loop.inputs.report(RankResult(event.call_id, self.tp.rank, result))
            self.loop.wake()

    def _collect(self, event: RankResult) -> None:
        pending = self._pending.get(event.call_id)
        if pending is None:
            return  # another rank, or a caller that gave up
        done, results = pending
        results[event.rank] = event.result
        if len(results) == self.tp.size and not done.done():
            done.set_result([results[rank] for rank in range(self.tp.size)])


@dataclass(slots=True)
class _Raised:
    """An exception a rank's function raised, as it travels to rank 0 (its type and message)."""

    kind: type[BaseException]
    message: str

    def exception(self) -> BaseException:
        try:
            return self.kind(self.message)
        except Exception:
            return RuntimeError(self.message)
