"""``HandOff``: the prefill role's decode stage, where a request leaves this worker.

A prefill worker computes a prompt and samples its first token; then the request goes on, with its
KV, on the decode worker that asked for it (which owns it: its deadline, its finish, its metrics).
Here the request waits in ``prefilled`` until the servicer takes it to finish its KV transfer
(``Scheduler.pop_prefilled``), and ends once the transfer did (``Scheduler.prefill_sent``).
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.scheduler.req import Req


class HandOff:
    """The requests whose first token is sampled, their KV still to be sent."""

    finishes_requests = False  # the decode worker finishes them, and counts them
    prompt_room = 1  # the decode worker goes on from the sampled token: the prompt must leave it room

    def __init__(self) -> None:
        self.prefilled: list[Req] = []  # first token sampled, KV complete: the servicer sends it
        self.running: list[Req] = []  # never any: nothing decodes here

    num_active = 0  # handed-on requests do not count toward max_running_requests
    runnable = False

    def schedule(self, in_flight: bool) -> tuple[list[Req], list[int]]:
        """Nothing decodes on a prefill worker."""
        return [], []

    def start(self, req: Req) -> None:
        """``req``'s last chunk is scheduled: it waits for its first token (nothing to do here)."""

    def hands_on(self, req: Req) -> bool:
        """``req``'s first token is sampled: it leaves this worker (True), and waits to be sent."""
        self.prefilled.append(req)
        return True

    def pop(self) -> list[Req]:
        reqs, self.prefilled = self.prefilled, []
        return reqs

    def remove(self, req: Req) -> None:
        if req in self.prefilled:
            self.prefilled.remove(req)

    def queues(self) -> Iterable[Iterable[Req]]:
        """The stage's requests, for ``Scheduler.state_digest``."""
        return (self.prefilled,)
