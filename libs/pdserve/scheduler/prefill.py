"""``PrefillManager``: prompts computed here, in chunks within a token budget (mixed and prefill roles).

Each step computes at most ``budget`` prompt tokens: the requests already extending continue first
(a long prompt in chunks, SGLang's chunked prefill), then waiting requests are admitted while budget
is left. A request leaves this stage once its last chunk is scheduled: its first token is being
sampled, and the decode stage takes it from there.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.scheduler.admission import Admission
from pdserve.scheduler.req import Req, ReqState
from pdserve.scheduler.schedule_batch import ScheduleBatch, kv_written


class PrefillManager:
    """The requests whose prompt is being computed here.

    Args:
        admission: admits waiting requests into this stage.
        outstanding: the scheduler's batches scheduled and not processed yet (oldest first): the
            chunks they run enter the radix cache only when processed.
    """

    def __init__(self, admission: Admission, outstanding: list[ScheduleBatch]) -> None:
        self.admission = admission
        self.outstanding = outstanding
        self.prefilling: list[Req] = []  # admitted, extending in chunks
        self.draining: dict[str, Req] = {}  # ended requests whose pages the stage holds: never any here

    @property
    def num_active(self) -> int:
        """Admitted requests this stage holds (they count toward ``max_running_requests``)."""
        return len(self.prefilling)

    @property
    def runnable(self) -> bool:
        return bool(self.prefilling)

    def schedule(self, budget: int) -> tuple[list[Req], list[int]]:
        """This step's extends: requests and how many prompt tokens each computes (sum <= ``budget``)."""
        reqs: list[Req] = []
        lens: list[int] = []

        def take(req: Req) -> None:
            nonlocal budget
            n = min(budget, req.seq_len - req.num_computed)
            reqs.append(req)
            lens.append(n)
            budget -= n

        for req in self.prefilling:  # continue chunked requests first
            if budget <= 0:
                break
            if not req.to_abort:  # (one being aborted ends when its batch in flight is processed)
                take(req)
        for req in self.admission.admit(self._in_flight, more=lambda: budget > 0):
            req.set_state(ReqState.PREFILLING)
            self.prefilling.append(req)
            take(req)
        return reqs, lens

    def _in_flight(self) -> list[Req]:
        """Requests whose prompt KV is being made: extending now, or in a batch still running whose
        chunks enter the cache when it is processed."""
        return self.prefilling + [r for b in self.outstanding for r in b.reqs[: b.num_extend]]

    def computed_tokens(self, req: Req) -> int:
        """Tokens of ``req`` whose KV is in the pool now: ``num_computed`` less the tokens of the
        scheduled batches not processed yet (their forwards may still be writing them)."""
        return kv_written(req, self.outstanding)

    def launched(self, req: Req) -> None:
        """``req``'s last chunk is scheduled: it leaves this stage."""
        self.prefilling.remove(req)

    def remove(self, req: Req) -> bool:
        """``req`` ended: it leaves the stage. False: the stage holds none of its pages on."""
        if req in self.prefilling:
            self.prefilling.remove(req)
        return False

    def queues(self) -> Iterable[Iterable[Req]]:
        """The stage's requests, for ``Scheduler.state_digest``."""
        return (self.prefilling,)
