"""Pick the decode-scheduler (and prefill-scheduler) of each sub-request, with a policy per pool
(``policies``). Unhealthy workers (marked by ``WorkerMonitor``) are skipped until they answer
SERVING again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.services.gateway.errors import GatewayError, retry_after
from pdserve.services.gateway.routing.kv_subscriptions import KVIndexes
from pdserve.services.gateway.routing.policies import KVAwareWeights, PolicyName, make_policy
from pdserve.services.gateway.routing.workers import Worker, WorkerPool


@dataclass(slots=True)
class Route:
    """Where one sub-request goes; ``release()`` once it ends (idempotent)."""

    decode: Worker
    prefill: Worker | None
    fallback_prefill_addresses: list[str] = field(default_factory=list)  # decode retries on these
    _released: bool = field(default=False, repr=False)

    @property
    def prefill_address(self) -> str:
        return self.prefill.address if self.prefill else ""

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.decode.in_flight -= 1
            if self.prefill:
                self.prefill.in_flight -= 1


class Router:
    """Routes tokenized requests over the decode pool and the (optional) prefill pool.

    With no prefill workers configured, ``Route.prefill`` is None and decode prefills locally.
    ``kv_indexes`` (role -> ``KVIndexes``, for ``kv_aware``) and ``weights`` go to each pool's policy.
    """

    def __init__(
        self,
        decode: WorkerPool,
        prefill: WorkerPool,
        policy: PolicyName,
        kv_indexes: dict[str, KVIndexes] | None = None,
        weights: KVAwareWeights | None = None,
    ) -> None:
        self.decode = decode
        self.prefill = prefill
        self.policy_name = policy
        kv_indexes = kv_indexes or {}
        self._decode_policy = make_policy(policy, kv_indexes.get("decode"), weights)
        self._prefill_policy = make_policy(policy, kv_indexes.get("prefill"), weights)

    def route(self, input_ids: Sequence[int], lora_name: str = "", avoid: Worker | None = None) -> Route:
        """Pick (decode, prefill) for ``input_ids`` under LoRA adapter ``lora_name`` ("": the base
        model) and count the request in flight on both; a decode worker ``avoid`` (one a migrated
        request leaves) is not picked.

        Raises:
            GatewayError: 503 when a configured role has no healthy worker (but ``avoid``).
        """
        candidates = self.decode.available()
        if avoid is not None:
            candidates = [w for w in candidates if w is not avoid]
            if not candidates:
                raise GatewayError(503, "no other healthy decode worker", headers=retry_after())
        decode = self._decode_policy.select(candidates, input_ids, lora_name)
        prefill = None
        fallbacks: list[str] = []
        if self.prefill:
            available = self.prefill.available()
            prefill = self._prefill_policy.select(available, input_ids, lora_name)
            prefill.in_flight += 1
            fallbacks = [w.address for w in available if w is not prefill]
        decode.in_flight += 1
        return Route(decode, prefill, fallbacks)

    def forget(self, role: str, worker: Worker) -> None:
        """Drop what the policy remembers about ``worker`` (it went unhealthy)."""
        policy = self._decode_policy if role == "decode" else self._prefill_policy
        policy.forget(worker)
