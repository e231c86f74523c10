"""``SplitPrefill``: a PD decode worker's prompts, each prefilled here or by a prefill worker.

Conditional disaggregation (NVIDIA Dynamo's disaggregated router prefills a prompt remotely only
when it is longer than ``max_local_prefill_length``; Splitwise and DistServe weigh the same
trade): a prompt whose uncached part is at most ``local_max_tokens`` costs this worker one short
chunk, less than the round trip, the prefill worker's step and the KV write over NIXL would add
to its TTFT, and on a machine whose prefill and decode workers share the same cores it saves the
work of two processes taking turns. Longer prompts go to a prefill worker as before, so a long
prompt never holds this worker's decode steps. ``local_max_tokens`` 0 sends every prompt away.

The decision is made at admission (``Admission.admit``'s ``takes``), from the radix cache's match
on this worker: the local stage (``PrefillManager``) admits first, in the policy's order, the
requests it takes; the remote stage (``RemotePrefill``) then the others. Every TP rank decides the
same, from the same cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pdserve.scheduler.prefill import PrefillManager
from pdserve.scheduler.remote_prefill import RemotePrefill
from pdserve.scheduler.req import Req


class SplitPrefill:
    """A local prefill stage and a remote one, each request in exactly one of them.

    Args:
        local: prompts computed here (its admission takes ``prefills_here`` requests).
        remote: prompts whose KV a prefill worker writes (its admission takes the others).
        uncached_tokens: how many of a waiting request's prompt tokens this worker's cache lacks.
        local_max_tokens: the most uncached prompt tokens a request prefilled here may have.
    """

    def __init__(
        self,
        local: PrefillManager,
        remote: RemotePrefill,
        uncached_tokens: Callable[[Req], int],
        local_max_tokens: int,
    ) -> None:
        self.local, self.remote = local, remote
        self.uncached_tokens = uncached_tokens
        self.local_max_tokens = local_max_tokens
        self.draining = remote.draining  # (the local stage holds no ended request's pages)
        self.metrics = remote.metrics

    def prefills_here(self, req: Req) -> bool:
        """Whether waiting ``req`` is prefilled on this worker (else a prefill worker writes its KV)."""
        return self.uncached_tokens(req) <= self.local_max_tokens

    # ---- the stage, as the scheduler drives it ------------------------------------------------
    @property
    def num_active(self) -> int:
        return self.local.num_active + self.remote.num_active

    @property
    def runnable(self) -> bool:
        return self.local.runnable

    @property
    def prefilling(self) -> list[Req]:
        return self.local.prefilling

    def schedule(self, budget: int) -> tuple[list[Req], list[int]]:
        """This step's local extends within ``budget`` tokens; then the requests a prefill worker
        prefills are admitted (they compute nothing here)."""
        before = {req.rid for req in self.local.prefilling}
        extends = self.local.schedule(budget, takes=self.prefills_here)
        for req in self.local.prefilling:
            if req.rid not in before:  # admitted just now
                req.prefilled_here = True
                self.metrics.local_prefills.inc()
        self.remote.schedule(budget, takes=lambda req: not self.prefills_here(req))
        return extends

    def launched(self, req: Req) -> None:
        self.local.launched(req)

    def computed_tokens(self, req: Req) -> int:
        return self.local.computed_tokens(req)

    def remove(self, req: Req) -> bool:
        return self.local.remove(req) or self.remote.remove(req)

    def queues(self) -> Iterable[Iterable[Req]]:
        return (*self.local.queues(), *self.remote.queues())

    # ---- the remote stage's handshake (``RemotePrefill``) ---------------------------------------
    @property
    def on_abandoned(self):
        return self.remote.on_abandoned

    @on_abandoned.setter
    def on_abandoned(self, hook) -> None:
        self.remote.on_abandoned = hook

    def pop_requests(self) -> list[Req]:
        return self.remote.pop_requests()

    def get(self, rid: str) -> Req | None:
        return self.remote.get(rid)

    def kv_ready(self, rid: str, first_token_id: int, *received):
        return self.remote.kv_ready(rid, first_token_id, *received)

    def kv_failed(self, rid: str, error: str, retryable: bool = False):
        return self.remote.kv_failed(rid, error, retryable)

    def kv_drained(self, rid: str) -> None:
        self.remote.kv_drained(rid)
