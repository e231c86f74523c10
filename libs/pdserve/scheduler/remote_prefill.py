"""``RemotePrefill``: prompts whose KV a prefill worker writes (the decode role of PD).

The PD handshake is decode-driven, so a prefill worker never computes for a request this worker
cannot hold: a request is admitted here with pages for its whole prompt reserved (radix-matched
against this worker's own cache first), and only then does the servicer ask a prefill worker for
the KV of the pages it lacks (``pop_requests``). A request then is

- **waiting** for its KV (``waiting_for_kv``), until
- **ready**: the prefill worker's write landed and its first token came (``kv_ready``): it decodes;
- **failed**: every prefill attempt failed (``kv_failed``): it ends, and like any request that ends
  while waiting (abort, deadline) it is
- **draining**: its pages stay held (``draining``), for a prefill worker may still be writing them,
  until the servicer says no Prefill call of it is in flight any more (``kv_drained``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pdserve.scheduler.admission import Admission
from pdserve.scheduler.req import FinishReason, Req, ReqState
from pdserve.scheduler.schedule_batch import StepOutput


class RemotePrefill:
    """The requests whose prompt KV a prefill worker is writing into this worker's pages.

    Args:
        admission: admits waiting requests into this stage.
        first_token: the scheduler takes a request whose KV landed, with its first token (and its
            logprob): it decodes from then on, or ends if that token finishes it.
        end: ends a request (``RequestTable.end``).

    Attributes:
        on_abandoned: called with a request that ends while its KV is arriving (the servicer stops
            the transfer); its pages are then held until ``kv_drained``. Without it they are freed
            at once.
    """

    def __init__(
        self,
        admission: Admission,
        first_token: Callable[[Req, int, tuple | None], StepOutput],
        end: Callable[[Req, FinishReason, str], None],
    ) -> None:
        self.admission = admission
        self.ledger = admission.ledger
        self.metrics = admission.metrics
        self._first_token = first_token
        self._end = end
        self.waiting_for_kv: dict[str, Req] = {}  # pages reserved, a prefill worker asked (or about to be)
        self.draining: dict[str, Req] = {}  # ended while their KV was arriving: pages held until drained
        self._to_ask: list[Req] = []  # admitted since the servicer last asked for them
        self.on_abandoned: Callable[[Req], None] | None = None

    @property
    def num_active(self) -> int:
        """Admitted requests this stage holds (they count toward ``max_running_requests``)."""
        return len(self.waiting_for_kv)

    @property
    def runnable(self) -> bool:
        """Nothing runs here: the stage's work is a prefill worker's."""
        return False

    def schedule(self, budget: int) -> tuple[list[Req], list[int]]:
        """Admit what fits; nothing to compute here (``budget`` is the local prefill's, unused)."""
        for req in self.admission.admit(lambda: list(self.waiting_for_kv.values())):
            req.set_state(ReqState.WAITING_FOR_KV)
            self.waiting_for_kv[req.rid] = req
            self._to_ask.append(req)
        return [], []

    def pop_requests(self) -> list[Req]:
        """The requests admitted since the last call: the servicer asks a prefill worker for each."""
        reqs, self._to_ask = self._to_ask, []
        return reqs

    def get(self, rid: str) -> Req | None:
        """``rid``'s request while it waits for its KV, else None."""
        return self.waiting_for_kv.get(rid)

    def kv_ready(
        self,
        rid: str,
        first_token_id: int,
        logprob=None,
        cached_tokens: int = 0,
        transferred_bytes: int = 0,
        prompt_logprobs=(),
        embedding=(),
    ) -> StepOutput | None:
        """A prefill worker wrote ``rid``'s prompt KV into our pages (``transferred_bytes``; its cache
        held ``cached_tokens`` of the prompt) and sampled its next token (under the request's grammar,
        if any: our own matcher advances by it), with the prompt logprobs and the embedding it
        computed when asked.
        The request leaves the stage to decode; None if it no longer waits for its KV (it ended
        meanwhile)."""
        req = self.waiting_for_kv.pop(rid, None)
        if req is None:
            return None
        if req.scores_prompt:
            req.prompt_logprobs = list(prompt_logprobs)
        if req.embeds_prompt:
            req.embedding = list(embedding)
        self.metrics.kv_transfer_bytes.inc(transferred_bytes)
        req.cached_tokens = max(req.cached_tokens, cached_tokens)
        req.num_computed = len(req.fill_ids)
        self.ledger.cache_unfinished(req)  # later requests share its prompt's pages at once
        return self._first_token(req, first_token_id, logprob)

    def kv_failed(self, rid: str, error: str, retryable: bool = False) -> StepOutput | None:
        """Every prefill of ``rid`` failed: it fails (``retryable``: for a reason of the servers'
        state, such as every prefill worker down or hung), its pages drain."""
        req = self.waiting_for_kv.get(rid)  # (``end`` takes it out, stopping its transfer)
        if req is None:
            return None
        req.retryable = retryable
        self._end(req, FinishReason.ERROR, error)
        return StepOutput(req, finished=True)

    def kv_drained(self, rid: str) -> None:
        """No prefill worker writes into ``rid``'s pages any more (its Prefill call ended): free the
        pages of a request that ended while they were arriving. No-op for any other rid."""
        req = self.draining.pop(rid, None)
        if req is not None:
            self.ledger.release(req, cache=False)

    def remove(self, req: Req) -> bool:
        """``req`` ended: it leaves the stage. If it was waiting for its KV and ``on_abandoned`` is
        set, that is called (the servicer stops the transfer) and its pages are held (True) until
        ``kv_drained``; without the hook nothing else writes its pages (False)."""
        if self.waiting_for_kv.pop(req.rid, None) is None or self.on_abandoned is None:
            return False
        self.on_abandoned(req)
        self.draining[req.rid] = req
        return True

    def queues(self) -> Iterable[Iterable[Req]]:
        """The stage's requests, for ``Scheduler.state_digest``."""
        return self.waiting_for_kv.values(), self.draining.values()
