"""The receiving side of a decode worker's KV transfers, on every rank of its TP group.

Each rank has its own NIXL agent and pool shard; the prefill ranks holding its KV heads write
them into it (``head_map``: prefill rank ``i`` into decode rank ``i`` under equal TP sizes, else
head slices, each rank from one or several prefill ranks). Rank 0 drives (it alone talks to
prefill workers) through ``RankCalls``, so every rank acts at the same step seam, in the same order:

- handshake: every rank describes its agent (``describe``); after the gRPC exchange rank 0 checks
  the head mapping and every rank loads the prefill ranks that write into it (``add_peers``);
- per attempt: every rank expects the transfer id (rank 0 picks it) into the request's pages, which
  are the same on every rank, from each of its senders (``expect``); rank 0 awaits its own receive
  and the other ranks' reports (``KVLanded``) that theirs completed: the request is landed only once
  every rank's shard is;
- an attempt that fails is cancelled on every rank (``KVLanding.cancel``), before a retry expects a
  fresh id; a request that ends while its KV arrives is abandoned on every rank by the scheduler's
  ``on_kv_abandoned`` hook (``abandon``), which runs at the same step on every rank (its pages are then freed
  once, through the same scheduler decision on each).

With one rank every call runs at once in the caller: what a decode worker without TP did.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.kv_transfer import (
    KVAgentInfo,
    KVLayout,
    KVReceive,
    KVTransferAgent,
    KVTransferError,
    KVTransferTimeout,
    head_map,
)
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import Scheduler
from pdserve.services.common.events import KVLanded
from pdserve.services.common.rank_calls import RankCalls
from pdserve.services.common.scheduler_loop import SchedulerLoop

logger = logging.getLogger(__name__)


class KVLanding:
    """One attempt's transfer as rank 0 sees it: its own receive and the other ranks' completion."""

    def __init__(self, ranks: KVRanks, rid: str, receive: KVReceive, others: asyncio.Future | None):
        self._ranks = ranks
        self.rid = rid
        self.receive = receive
        self._others = others

    async def wait(self, timeout_s: float) -> int:
        """Once every rank's shard landed: rank 0's bytes.

        Raises:
            KVTransferError: a rank's receive failed or was cancelled. KVTransferTimeout: too slow.
        """
        start = time.monotonic()
        nbytes = await self.receive.wait(timeout_s)
        if self._others is not None:
            left = max(0.1, timeout_s - (time.monotonic() - start))
            try:
                await asyncio.wait_for(asyncio.shield(self._others), left)
            except TimeoutError:
                raise KVTransferTimeout(
                    f"KV transfer {self.receive.tid!r}: another TP rank's shard is missing after"
                    f" {timeout_s:.3g} s"
                ) from None
        return nbytes

    def cancel(self) -> None:
        """Stop expecting the transfer on every rank (no-op where it completed). Idempotent."""
        self.receive.cancel()
        if self._ranks.receives.get(self.rid) is self.receive:
            del self._ranks.receives[self.rid]
        others = self._others
        if others is not None:
            self._ranks.others.pop(self.receive.tid, None)
            self._ranks._landed.pop(self.receive.tid, None)
            landed = others.done() and not others.cancelled() and others.exception() is None
            if not landed:
                self._ranks.calls.broadcast("cancel", self.rid, self.receive.tid)
            others.cancel()  # no-op once done


class KVRanks:
    """This rank's part of the decode worker's KV receiving (see the module docstring).

    Args:
        agent: this rank's NIXL agent.
        scheduler: this rank's scheduler (the requests waiting for KV own the pages written).
        loop: this rank's scheduler loop (the seam where rank 0's calls run).

    Attributes:
        receives: rid -> this rank's receive in flight.
        peer_names: prefill worker address -> the NIXL agents this rank receives from, with how many
            of its KV heads each writes.
    """

    def __init__(self, agent: KVTransferAgent, scheduler: Scheduler, loop: SchedulerLoop) -> None:
        self.agent = agent
        self.scheduler = scheduler
        self.tp = loop.tp
        self.calls = RankCalls(
            loop,
            {
                "describe": self.agent.local_info,
                "add_peer": self._add_peer,
                "forget_peer": self._forget_peer,
                "expect": self._expect,
                "cancel": self._cancel,
            },
        )
        self.loop = loop
        loop.handlers[KVLanded] = self._on_landed
        self.receives: dict[str, KVReceive] = {}
        self.peer_names: dict[str, dict[str, int]] = {}
        self.others: dict[bytes, asyncio.Future] = {}  # rank 0: tid -> the other ranks' shards landed
        self._landed: dict[bytes, set[int]] = {}  # rank 0: tid -> the other ranks landed so far

    # ---- rank 0 ---------------------------------------------------------------------------
    async def describe(self) -> list[KVAgentInfo]:
        """Every rank's agent info, rank order."""
        return await self.calls.call("describe")

    async def add_peers(self, address: str, mine: list[KVAgentInfo], infos: list[KVAgentInfo]) -> None:
        """Every rank loads, of the prefill worker at ``address`` (its ranks' ``infos``), the ranks
        that write its KV heads (``head_map`` of this worker's ``mine`` and ``infos``).

        Raises:
            KVLayoutMismatch: the layouts cannot be paired (the message names both sides' TP sizes
                and head ranges). KVTransferError: NIXL failed.
        """
        layouts = [info.layout for info in mine]
        head_map(layouts, [info.layout for info in infos])  # refused here, before any rank loads one
        await self.calls.call("add_peer", address, layouts, infos)

    def forget_peers(self, address: str) -> None:
        """Every rank drops its NIXL peer at ``address`` (a hung worker)."""
        self.calls.broadcast("forget_peer", address)

    async def expect(self, req: Req, address: str, tid: bytes, timeout_s: float) -> KVLanding:
        """Every rank expects transfer ``tid`` from the worker at ``address`` into ``req``'s pages.

        Raises:
            KVTransferError: a rank could not (no peer for ``address``, the request ended meanwhile).
        """
        others = None
        if self.tp.size > 1:
            others = self.others[tid] = asyncio.get_running_loop().create_future()
            self._landed[tid] = set()
        try:
            await self.calls.call("expect", req.rid, address, tid, timeout_s)
        except BaseException:
            self.others.pop(tid, None)
            self._landed.pop(tid, None)
            self.calls.broadcast("cancel", req.rid, tid)
            raise
        return KVLanding(self, req.rid, self.receives[req.rid], others)

    # ---- every rank ---------------------------------------------------------------------------
    def abandon(self, req: Req) -> None:
        """The scheduler frees ``req``'s pages next (``on_kv_abandoned``): stop its transfer first."""
        receive = self.receives.pop(req.rid, None)
        if receive is not None:
            receive.cancel()

    def _add_peer(self, address: str, layouts: list[KVLayout], infos: list[KVAgentInfo]) -> None:
        senders: dict[str, int] = {}
        for route in head_map(layouts, [info.layout for info in infos]):
            if route.dst_rank == self.tp.rank:
                sender = infos[route.src_rank]
                self.agent.add_peer(sender)
                heads = route.heads.num_heads if route.heads else self.agent.layout.num_kv_heads
                senders[sender.agent_name] = heads
        self.peer_names[address] = senders

    def _forget_peer(self, address: str) -> None:
        for name in self.peer_names.pop(address, {}):
            self.agent.remove_peer(name)

    def _expect(self, rid: str, address: str, tid: bytes, timeout_s: float) -> None:
        req = self.scheduler.waiting_for_kv(rid)
        if req is None:
            raise KVTransferError(f"{rid} no longer waits for its KV")
        senders = self.peer_names.get(address)
        if senders is None:
            raise KVTransferError(f"no KV peer for prefill worker {address}")
        local_pages = self.scheduler.ledger.arriving_local_pages(req)
        receive = self.agent.expect(senders, tid, req.pages[req.num_prefix_pages :], local_pages)
        self.receives[rid] = receive
        if not self.tp.is_driver:
            asyncio.get_running_loop().create_task(self._report_landed(rid, receive, timeout_s))

    def _cancel(self, rid: str, tid: bytes) -> None:
        receive = self.receives.get(rid)
        if receive is not None and receive.tid == tid:
            del self.receives[rid]
            receive.cancel()

    async def _report_landed(self, rid: str, receive: KVReceive, timeout_s: float) -> None:
        """Ranks > 0: tell every rank (rank 0 listens) when this rank's shard ended."""
        try:
            await receive.wait(timeout_s)
            error = ""
        except KVTransferError as e:
            error = str(e) or type(e).__name__
        if self.receives.get(rid) is receive:
            del self.receives[rid]
        self.loop.inputs.report(KVLanded(receive.tid, self.tp.rank, error))
        self.loop.wake()

    def _on_landed(self, event: KVLanded) -> None:
        others = self.others.get(event.tid)
        if others is None or others.done():
            return  # not rank 0, or the attempt ended
        if event.error:
            others.set_exception(KVTransferError(f"TP rank {event.rank}: {event.error}"))
            return
        landed = self._landed[event.tid]
        landed.add(event.rank)
        if len(landed) == self.tp.size - 1:
            others.set_result(None)
