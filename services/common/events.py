"""Every event that crosses into a scheduler loop, in one module, grouped by who sends it.

Handlers (gRPC calls, transfer tasks, other TP ranks) never touch the scheduler: they submit events,
which the loop applies at one point per iteration, in arrival order, identically on every TP rank
(``step_inputs``); each event type has a handler in ``SchedulerLoop.handlers``. Events travel to
the other ranks pickled, so they hold plain values.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.scheduler.req import FinishReason, Req

if TYPE_CHECKING:  # (the NIXL bindings load with pdserve.kv_transfer: only the roles that use them)
    from pdserve.kv_transfer import KVAgentInfo
    from pdserve.sampling.prompt_logprobs import PromptLogprob

# ---- every role: rank 0's gRPC handlers --------------------------------------------------------


@dataclass(slots=True)
class NewRequest:
    """A request for ``Scheduler.add_request`` (checked by rank 0's handler already)."""

    req: Req

    def __reduce__(self):
        """Pickled for the other ranks without rank 0's tracing span (``Req.span``, an object of rank
        0's process that the other ranks neither can nor need to hold)."""
        if self.req.span is None:
            return NewRequest, (self.req,)
        req = copy.copy(self.req)
        req.span = None
        return NewRequest, (req,)


@dataclass(slots=True)
class Abort:
    """``Scheduler.abort_request(rid, reason, finish_reason)``, or the role's own abort path."""

    rid: str
    reason: str
    finish_reason: FinishReason = FinishReason.ABORT


@dataclass(slots=True)
class Call:
    """``fn(scheduler, *args)`` at the seam; ``fn`` is a module-level function or a ``Scheduler``
    method (it travels to every rank by name)."""

    fn: Callable[..., Any]
    args: tuple


# ---- every role: rank 0 and the other ranks of a TP group (``rank_calls``) -------------------------


@dataclass(slots=True)
class RankCall:
    """Run ``functions[name](*args)`` on every rank; each reports a ``RankResult`` (none for
    ``call_id`` -1, a broadcast)."""

    call_id: int
    name: str
    args: tuple


@dataclass(slots=True)
class RankResult:
    """Rank ``rank``'s result of call ``call_id`` (picklable)."""

    call_id: int
    rank: int
    result: Any


# ---- decode role: the PD coordinator's prefill tasks (rank 0) and the KV receivers (every rank) ---


@dataclass(slots=True)
class KVReady:
    """A prefill worker wrote ``rid``'s prompt KV (every rank's shard) and sampled its first token."""

    rid: str
    first_token_id: int
    logprob: tuple[float, list[tuple[int, float]]] | None
    cached_tokens: int
    transferred_bytes: int
    # the prompt logprobs prefill computed, when asked (``Req.prompt_logprobs``)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    # the embedding prefill pooled, when asked (``Req.embedding``)
    embedding: list[float] = field(default_factory=list)


@dataclass(slots=True)
class KVFailed:
    """Every prefill attempt for ``rid`` failed (``retryable``: each for the prefill pool's state)."""

    rid: str
    error: str
    retryable: bool


@dataclass(slots=True)
class KVDrained:
    """Rank 0's prefill task for ``rid`` ended: no Prefill call of it is in flight, so no prefill
    worker writes into its pages any more (those of a request that ended meanwhile are released)."""

    rid: str


@dataclass(slots=True)
class KVLanded:
    """Rank ``rank``'s shard of transfer ``tid`` ended: ``error`` is empty when every page landed."""

    tid: bytes
    rank: int
    error: str


# ---- prefill role: the handshake handler (rank 0) and the KV writers (every rank) ------------------


@dataclass(slots=True)
class AddKVPeers:
    """A decode worker's agents, one per rank (rank order): each rank of this group loads those it
    writes KV heads into (``head_map``)."""

    agents: list[KVAgentInfo]


@dataclass(slots=True)
class KVWritten:
    """Rank ``rank``'s KV write for ``rid`` ended: ``error`` is empty when every byte landed."""

    rid: str
    rank: int
    error: str
    nbytes: int
