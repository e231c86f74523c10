"""The one point per scheduler-loop iteration where inputs enter, identically on every TP rank.

Everything that changes a scheduler from outside its own steps is an event: a new request, an
abort, and in PD a prefill worker's first token or a finished KV write (every type is in
``events``). Handlers (gRPC calls, transfer tasks) never touch the scheduler. Rank 0's handlers
``submit`` events; any rank may ``report`` events about its own work (its shard of a KV write
finished). At the top of each iteration ``exchange`` gives every rank the same ``StepInputs`` (one
all-gather over the gloo control group): rank 0's clock reading and submitted events, then every
rank's reports in rank order, and every rank's state digest after its previous step. Each rank
applies the events in that order, so the schedulers of all ranks make the same decisions (the
design brief's TP worker: rank 0 receives requests and synchronises them, and their order, to the
other ranks; SGLang broadcasts them with ``broadcast_pyobj``). With one rank ``exchange`` is a
local hand-over.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pdserve.distributed import TpGroup


@dataclass(slots=True)
class StepInputs:
    """What every rank applies before scheduling one step.

    Attributes:
        now: rank 0's ``time.time()``: the scheduler clock of this step on every rank.
        stop: rank 0 is stopping; every rank leaves its loop.
        events: rank 0's submitted events in arrival order (on rank 0 the objects its handlers
            submitted, elsewhere their copies), then each rank's reports in rank order.
        done: aligned with ``events``: on rank 0 the future of each event it submitted, else None.
        digests: each rank's ``Scheduler.state_digest()`` after its previous step (None before the
            first step, and with one rank).
    """

    now: float
    stop: bool
    events: list[Any] = field(default_factory=list)
    digests: list[str | None] = field(default_factory=list)
    done: list[asyncio.Future | None] = field(default_factory=list)


class InputSync:
    """Collects a rank's events between iterations and exchanges them at the iteration's start.

    ``submit`` and ``report`` may be called from any coroutine of the rank's event loop; ``exchange``
    runs the collective on its own thread, so the loop keeps serving handlers (and transfers keep
    polling) while a rank waits for the others.
    """

    def __init__(self, tp: TpGroup) -> None:
        self.tp = tp
        self._submitted: list[Any] = []
        self._done: list[asyncio.Future | None] = []
        self._reported: list[Any] = []
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tp-sync") if tp.size > 1 else None

    def submit(self, event: Any, done: asyncio.Future | None = None) -> None:
        """An input from outside (rank 0): a request, an abort, a prefill worker's answer; ``done``
        (rank 0's, never sent) learns how applying it went."""
        self._submitted.append(event)
        self._done.append(done)

    def report(self, event: Any) -> None:
        """An input about this rank's own work, which every rank must learn (e.g. its KV write ended)."""
        self._reported.append(event)

    def pending(self) -> list[Any]:
        """Events submitted since the last exchange."""
        return self._submitted

    async def exchange(self, stop: bool, digest: str | None) -> StepInputs:
        """Hand over this iteration's inputs (a collective: every rank calls it once per iteration).

        Raises:
            RuntimeError: a peer rank died or did not answer within the group's timeout.
        """
        mine = (time.time(), stop, self._submitted, self._reported, digest)
        done = self._done
        self._submitted, self._reported, self._done = [], [], []
        if self._thread is None:
            events = mine[2] + mine[3]
            return StepInputs(mine[0], stop, events, [digest], done + [None] * len(mine[3]))
        loop = asyncio.get_running_loop()
        gathered = await loop.run_in_executor(self._thread, self.tp.all_gather_object, mine)
        now, stop, submitted = gathered[0][:3]
        if self.tp.is_driver:  # rank 0 applies its own objects (its handlers hold them), as with one rank
            submitted = mine[2]
        events = list(submitted) + [event for rank in gathered for event in rank[3]]
        if not self.tp.is_driver:
            done = [None] * len(submitted)
        done += [None] * (len(events) - len(submitted))
        return StepInputs(now, stop, events, [rank[4] for rank in gathered], done)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
