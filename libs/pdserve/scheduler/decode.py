"""``DecodeManager``: the running requests, each computing its next token every step (mixed and
decode roles), and their retraction when the KV pool runs short.

Every step each running request gets KV slots for the tokens it computes (``num_tokens``: its last
sampled token, and the draft tokens it verifies when a ``Speculator`` drafted for it). When the pool
cannot give them all, drafts go first (the step decodes plainly); then the request the policy ranks
last is retracted: its computed KV goes to the radix cache, its pages back to the pool, and it
waits again at the front of the queue with the tokens it generated, to be re-extended later
(SGLang's retraction).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pdserve.scheduler.kv_ledger import KVLedger
from pdserve.scheduler.metrics import SchedulerMetrics
from pdserve.scheduler.policy import SchedulePolicy
from pdserve.scheduler.req import Req, ReqState
from pdserve.scheduler.speculator import Speculator
from pdserve.scheduler.waiting import WaitingQueue

logger = logging.getLogger(__name__)


class DecodeManager:
    """The requests decoding here.

    Args:
        ledger: grows their pages.
        queue: where a retracted request waits again.
        policy: which request is retracted first.
        metrics: counts retractions.
        max_req_tokens: a request that reaches this many tokens ends (so needs no slot beyond it).
        speculator: drafts tokens for the running requests to verify (speculative decoding), or None.
    """

    finishes_requests = True  # a request ends here (and is counted as finished here)
    prompt_room = 0  # a prompt may fill the context: it then ends by length at its first token

    def __init__(
        self,
        ledger: KVLedger,
        queue: WaitingQueue,
        policy: SchedulePolicy,
        metrics: SchedulerMetrics,
        max_req_tokens: int,
        speculator: Speculator | None = None,
    ) -> None:
        self.ledger = ledger
        self.queue = queue
        self.policy = policy
        self.metrics = metrics
        self.max_req_tokens = max_req_tokens
        self.speculator = speculator
        self.running: list[Req] = []

    @property
    def num_active(self) -> int:
        return len(self.running)

    @property
    def runnable(self) -> bool:
        return bool(self.running)

    def num_tokens(self, req: Req) -> int:
        """Tokens ``req`` computes in a step: its last sampled one and its drafts."""
        return 1 + len(req.drafts)

    def start(self, req: Req) -> None:
        """``req``'s first token is being sampled (its prompt's last chunk is scheduled, or its KV came
        from a prefill worker): it runs from now on."""
        req.set_state(ReqState.RUNNING)
        self.running.append(req)

    def hands_on(self, req: Req) -> bool:
        """Whether ``req`` leaves this worker with its first token (never: it decodes here)."""
        return False

    def remove(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
            if self.speculator is not None:
                self.speculator.release(req.rid)

    def schedule(self, in_flight: bool) -> tuple[list[Req], list[int]] | None:
        """Give every running request KV slots for this step's tokens, retracting if the pool is short.

        Skips requests being aborted and those whose pending tokens end them by length.

        Args:
            in_flight: a scheduled batch is not processed yet (the overlap loop).

        Returns:
            The decoding requests (oldest admitted first) and the tokens each computes; or None when
            this step needs the token ids of the batch in flight first: a request with a pending
            token has penalties (they count its output tokens) or a grammar (its next mask follows
            from them), or a retraction is due (the batch in flight reads its victim's KV where it
            is), or the step speculates (drafts follow the verified tokens). The caller then processes
            that batch and schedules again.
        """
        if in_flight and any(
            r.num_pending and (r.sampling_params.has_penalties or r.grammar is not None) for r in self.running
        ):
            return None
        order = self.policy.retraction_order(self.running)

        def wants_slot(req: Req) -> bool:  # False too once retracted to make room for an older one
            if req.state is not ReqState.RUNNING or req.to_abort:
                return False
            return not (req.num_pending and req.will_finish_by_length(self.max_req_tokens))

        for req in self.running:
            req.drafts, req.draft_probs = [], None
        spec = self.speculator
        if spec is not None:
            decoding = [req for req in order if wants_slot(req)]
            if decoding and spec.wants(decoding, self.max_req_tokens, in_flight):
                if any(req.num_pending for req in decoding):
                    return None  # the drafts follow the token ids a batch in flight samples
                spec.draft(decoding, self.max_req_tokens)

        def positions(req: Req) -> int:  # the KV positions it needs once this step ran
            return req.seq_len + self.num_tokens(req) - 1

        batch = [req for req in order if wants_slot(req)]
        if not self.ledger.grow_all(batch, [positions(req) for req in batch]):
            for req in batch:  # the pool is short: no drafts this step
                req.drafts, req.draft_probs = [], None
            batch = []  # the pool cannot give everyone a page: grow one by one, oldest first
            for req in order:
                if not wants_slot(req):
                    continue
                while not self.ledger.grow(req, positions(req)):
                    if in_flight:
                        return None
                    victim = next(r for r in reversed(order) if r.state is ReqState.RUNNING)
                    self.retract(victim)
                    if victim is req:
                        break
                else:
                    batch.append(req)
        return batch, [self.num_tokens(req) for req in batch]

    def retract(self, req: Req, why: str = "to free KV pages") -> None:
        """Give ``req``'s pages back (its computed KV goes to the radix cache) and re-queue it;
        ``why`` is logged."""
        logger.info(
            "retracting %s (%d tokens generated) %s",
            req.rid,
            len(req.output_ids),
            why,
            extra={"rid": req.rid},
        )
        self.running.remove(req)
        self.ledger.release(req, cache=True)
        req.drafts, req.draft_probs = [], None
        req.set_state(ReqState.WAITING)
        self.queue.requeue(req)
        self.metrics.retracted.inc()

    def queues(self) -> Iterable[Iterable[Req]]:
        """The stage's requests, for ``Scheduler.state_digest``."""
        return (self.running,)
