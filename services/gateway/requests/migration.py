"""Request migration: a choice whose decode worker is lost continues on another one (Dynamo's
request migration, bounded by ``--migration-limit`` as Dynamo names it).

The gateway owns the client's stream, so the gateway migrates. A choice keeps the output ids it has
pushed to its client (``ReqState.output_ids``); when its decode worker is lost (its output stream
ended, it failed the health probes or restarted, or it is draining) the choice is aborted there and
sent to another healthy decode worker (in PD through a prefill worker again, whose radix cache holds
the prompt) as a continuation: the prompt ids plus ``resumed_output_ids``, which the scheduler counts
as output (``max_new_tokens``, ``min_new_tokens``, stops, penalties, the seeded sampler's step go on
exactly), and which the detokenizer's fresh decode state starts after (no text repeated or lost).

The continuation has a rid of its own, the choice's rid with ``.m{n}`` for its n-th migration: the
outputs a lost worker still sends for the old rid (a hung worker woken by SIGCONT, a draining one)
find no choice in the registry and are dropped, so nothing reaches the client twice. A choice that
moved ``migration_limit`` times, or that has nowhere to go, ends with the error it had before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping

from pdserve.services.gateway.errors import GatewayError
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.requests.state import ReqState, RequestHandle, RequestRegistry
from pdserve.services.gateway.routing.router import Router

logger = logging.getLogger(__name__)

MAX_MIGRATION_LIMIT = 16


class Migrator:
    """Moves choices off lost decode workers.

    Args:
        limit: migrations per choice, in ``[0, MAX_MIGRATION_LIMIT]`` (0: none, a lost worker's
            choices end with a retryable error).
        handles: the replica's in-flight requests (``RequestManager.handles``).
        router: picks the new decode (and prefill) worker.
        registry: the replica's rid -> choice map (the continuation's rid replaces the old one).
        metrics: ``pdserve:gateway_migrations_total{reason}``.
        send: sends a choice to its route with an arrival time and deadline (``time.time()`` s;
            0 = none), raising ``GatewayError`` when the worker refuses it.
        abort_backend: aborts a choice at its current decode worker (in the background).
        spawn: runs a coroutine in the background.

    Raises:
        ValueError: ``limit`` out of bounds.
    """

    def __init__(
        self,
        limit: int,
        handles: Mapping[object, RequestHandle],
        router: Router,
        registry: RequestRegistry,
        metrics: GatewayMetrics,
        send: Callable[[ReqState, float, float], Awaitable[None]],
        abort_backend: Callable[[ReqState, str], None],
        spawn: Callable[[Coroutine], None],
    ) -> None:
        if not 0 <= limit <= MAX_MIGRATION_LIMIT:
            raise ValueError(f"--migration-limit must be in [0, {MAX_MIGRATION_LIMIT}], got {limit}")
        self.limit, self.handles, self.router = limit, handles, router
        self.registry, self.metrics = registry, metrics
        self.send, self.abort_backend, self.spawn = send, abort_backend, spawn

    def worker_down(self, role: str, address: str) -> None:
        """Migrate (a decode worker's) or end (finish_reason "error", retryable) every choice that
        depends on a worker that went down or restarted (``WorkerMonitor``'s ``on_down``).

        Its outputs would never arrive: a dead decode-scheduler holds the request, a dead
        detokenizer carries its text. (A dead prefill-scheduler is the decode-scheduler's to handle.)
        """
        if role == "decode":
            depends = lambda s: s.route is not None and s.route.decode.address == address
        elif role == "detokenizer":
            depends = lambda s: s.output_address == address
        else:
            return
        reason = f"{role} worker {address} went down or restarted; retry"
        for handle in list(self.handles.values()):
            lost = [s for s in handle.states if not s.finished and depends(s)]
            lost = [s for s in lost if role != "decode" or not self.migrate(s, "worker_down")]
            if lost:
                handle.abort(reason, lost, finish_reason="error", retryable=True)

    def worker_draining(self, role: str, address: str) -> None:
        """Migrate every choice on the decode worker at ``address``, which started draining
        (scale-down; ``WorkerMonitor``'s ``on_drain``); one that may not migrate stays there until it
        finishes, as without migration."""
        for handle in list(self.handles.values()) if role == "decode" else ():
            for s in handle.states:
                if not s.finished and s.route is not None and s.route.decode.address == address:
                    self.migrate(s, "draining")

    def migrate(self, state: ReqState, reason: str) -> bool:
        """Continue ``state`` on another decode worker; False (nothing changed) when it may not: it
        ended or its request is closing, it was not sent (yet), it moved ``limit`` times already, it
        has no output left to generate, or no other decode worker is healthy. ``reason`` labels the
        metric: stream_ended, worker_down or draining."""
        route, owner = state.route, state.owner
        if (
            state.migrations >= self.limit
            or route is None
            or not state.sent  # its first send is still to come (with its route) or was refused
            or state.finished
            or owner.closed
            or owner.abort_reason
            or len(state.output_ids) >= state.sampling_params.max_new_tokens
        ):
            return False
        try:
            ids, adapter = state.input_ids + state.output_ids, state.sampling_params.lora_name
            new_route = self.router.route(ids, adapter, avoid=route.decode)
        except GatewayError as e:
            logger.warning("request %s cannot migrate: %s", state.rid, e.message, extra={"rid": state.rid})
            return False
        old_rid, old_address = state.rid, route.decode.address
        # a lost worker may still run it (hung, draining): it must drop it
        self.abort_backend(state, f"migrated to decode worker {new_route.decode.address}")
        if state.sending is not None:
            state.sending.cancel()
        route.release()
        state.migrations += 1
        base = old_rid.rsplit(".m", 1)[0] if state.migrations > 1 else old_rid
        self.registry.rename(state, f"{base}.m{state.migrations}")
        state.route, state.sent = new_route, False
        self.metrics.migrations.labels(reason=reason).inc()
        logger.warning(
            "request %s migrates (%s) from decode worker %s to %s as %s after %d output tokens (%d of %d)",
            old_rid, reason, old_address, new_route.decode.address, state.rid, len(state.output_ids),
            state.migrations, self.limit, extra={"rid": old_rid},
        )  # fmt: skip
        self.spawn(self._resend(state))
        return True

    async def _resend(self, state: ReqState) -> None:
        deadline = state.owner.deadline
        deadline_unix = 0.0 if deadline is None else time.time() + max(deadline - time.monotonic(), 1e-3)
        try:
            await self.send(state, time.time(), deadline_unix)
        except GatewayError as e:
            retryable = e.status in (429, 503)
            state.owner.abort(e.message, [state], finish_reason="error", retryable=retryable)
