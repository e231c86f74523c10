"""A prefill worker's KV transfers into decode workers' pages, on every rank of its TP group.

A request's transfer opens when it is queued (rank 0 opens its own in the Prefill handler, so that a
bad destination fails the call at once; the other ranks open theirs when the request reaches them).
After every scheduling step the pages its processed chunks filled are sent (``stream_chunks``; with
the overlapped loop a chunk whose batch is still outstanding is not), so they move while later
chunks compute; the rest go once the last chunk has sampled the first token, and with them, over
an SWA pool, the local-layer pages of the prompt's last window (``_send_local_pages``). Each rank reports when
its own write ended (``KVWritten``); once every rank's write landed (or one failed) every rank
caches or frees the pages at the same step, and rank 0 answers the call. A transfer is cancelled (no
page of it read any more) before the scheduler's pages of an ended request can go to another one:
on abort, and at the first step after a scheduler-side end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.distributed import TpGroup
from pdserve.kv_transfer import KVAgentInfo, KVFanout, KVLayout, KVTransferAgent, KVTransferError, head_map
from pdserve.kv_transfer.head_map import HeadSlice
from pdserve.scheduler.req import Req
from pdserve.scheduler.scheduler import Scheduler
from pdserve.services.common.events import AddKVPeers, KVWritten, NewRequest
from pdserve.services.common.scheduler_loop import SchedulerLoop

logger = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 30.0


@dataclass(slots=True)
class Outbound:
    """This rank's transfers of one request's KV (into each decode rank it writes), and how far they got."""

    transfer: KVFanout
    sent_pages: int = 0  # of the destination pages
    prefilled_at: float = 0.0  # time.monotonic() when its first token was sampled


class KVSends:
    """This rank's KV transfers (see the module docstring).

    Args:
        scheduler: the prefill-role scheduler.
        loop: its loop (the events' handlers are registered there).
        agent: this rank's NIXL agent.
        rank_layouts: every rank's pool layout (rank order): which heads each holds.
        on_settled: rank 0: called with a request once its transfer settled: ``error`` ("" when
            every rank's write landed), the bytes every rank wrote, and the seconds from its first
            token to the end of its write (the Prefill call answers then).
        stream_chunks: send a chunked prompt's finished pages after each chunk (else all at the end).
        transfer_timeout_s: how long a transfer may wait for the decode side (a free slot, a WRITE's
            completion), and at most for the end of its write after the prompt's last chunk.

    Attributes:
        opening: rank 0: transfers its handler opened, the request not queued yet.
        transfers: this rank's open transfers, by rid.
        finishing: prefilled rids, awaiting the end of this rank's write.
        written: prefilled rids: each rank's ended write.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        loop: SchedulerLoop,
        agent: KVTransferAgent,
        rank_layouts: list[KVLayout],
        on_settled: Callable[[Req, str, int, float], None],
        stream_chunks: bool = True,
        transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
    ) -> None:
        self.scheduler = scheduler
        self.loop = loop
        self.tp: TpGroup = loop.tp
        self.agent = agent
        self.rank_layouts = rank_layouts
        self.on_settled = on_settled
        self.stream_chunks = stream_chunks
        self.transfer_timeout_s = transfer_timeout_s
        self.opening: dict[str, KVFanout] = {}
        self.transfers: dict[str, Outbound] = {}
        self.finishing: dict[str, asyncio.Task] = {}
        self.written: dict[str, dict[int, KVWritten]] = {}
        # decode rank 0's agent -> the agents this rank writes into, with the heads it writes each
        self.rank_peers: dict[str, list[tuple[str, HeadSlice | None]]] = {}
        loop.handlers.update(
            {NewRequest: self._add, AddKVPeers: self._add_rank_peer, KVWritten: self._written}
        )

    def busy(self) -> bool:
        return bool(self.opening or self.transfers or self.finishing or self.written)

    def add_peers(self, agents: list[KVAgentInfo]) -> None:
        """Load the decode ranks (``agents``, rank order) this rank writes heads into (``head_map``).

        Raises:
            KVLayoutMismatch: the two groups' layouts cannot be paired (the message names both sides'
                TP sizes and head ranges). KVTransferError: NIXL could not load a peer.
        """
        routes = head_map([a.layout for a in agents], self.rank_layouts)
        mine = [(agents[r.dst_rank], r.heads) for r in routes if r.src_rank == self.tp.rank]
        for info, _ in mine:
            self.agent.add_peer(info)
        self.rank_peers[agents[0].agent_name] = [(info.agent_name, heads) for info, heads in mine]

    def open(self, req: Req) -> KVFanout:
        """Open ``req``'s transfers from this rank into its destination pages (of each decode rank).

        Raises:
            ValueError: a destination page out of range. KVTransferError: no such peer (NIXL).
        """
        route = req.route
        peers = self.rank_peers.get(route.kv_dst_agent)
        if peers is None:
            raise KVTransferError(f"unknown decode agent {route.kv_dst_agent!r}: exchange agent info first")
        dst, local = list(route.kv_dst_pages), list(route.kv_dst_local_pages)
        tid, timeout = route.kv_transfer_id, self.transfer_timeout_s
        transfers = []
        try:
            for peer, heads in peers:
                transfers.append(self.agent.start_transfer(peer, tid, dst, timeout, local, heads))
        except BaseException:
            KVFanout(transfers, 0, 0).cancel()
            raise
        # the pool's destinations (none where every layer is local: its pages then hold no KV)
        num_full = len(dst) if self.agent.layout.page_bytes else 0
        return KVFanout(transfers, num_full, len(local))

    def cancel(self, rid: str) -> None:
        """Stop ``rid``'s transfer at once (no page of it is read any more)."""
        transfer = self.opening.pop(rid, None)
        if transfer is not None:
            transfer.cancel()
        out = self.transfers.pop(rid, None)
        if out is not None:
            out.transfer.cancel()

    # ---- events, applied on every rank in rank 0's order ------------------------------------
    def _add(self, event: NewRequest) -> int:
        """Queue the request with this rank's transfer open (rank 0 opened its own in the handler).
        A rank that cannot open one still queues the request, so every rank schedules the same; its
        write then fails at once, which fails the prefill on every rank at the same step."""
        req = event.req
        transfer = self.opening.pop(req.rid, None) if self.tp.is_driver else self._open_rank_transfer(req)
        try:
            position = self.loop.add_request(event)
        except Exception:  # refused (on every rank alike): nothing reads its pages
            if transfer is not None:
                transfer.cancel()
            raise
        if transfer is not None:
            self.transfers[req.rid] = Outbound(transfer)
        return position

    def _open_rank_transfer(self, req: Req) -> KVFanout | None:
        try:
            return self.open(req)
        except (ValueError, KVTransferError) as e:
            logger.error("TP rank %d cannot open the KV transfer of %s: %s", self.tp.rank, req.rid, e)
            return None

    def _add_rank_peer(self, event: AddKVPeers) -> None:
        """This rank's decode peers (rank 0 loaded its own in the handshake). A peer that cannot be
        loaded here fails this rank's transfers to it, which fails those prefills cleanly."""
        if self.tp.is_driver:
            return
        try:
            self.add_peers(event.agents)
        except Exception as e:
            logger.error(
                "TP rank %d cannot add the KV peers of %s: %s", self.tp.rank, event.agents[0].agent_name, e
            )

    def _written(self, event: KVWritten) -> None:
        ended = self.written.get(event.rid)
        if ended is None:
            return  # aborted or failed already
        ended[event.rank] = event
        if event.error:
            where = f" on TP rank {event.rank}" if self.tp.size > 1 else ""
            self.settle(event.rid, f"KV transfer failed{where}: {event.error}")
        elif len(ended) == self.tp.size:
            self.settle(event.rid, "")

    def settle(self, rid: str, error: str) -> None:
        """Every rank's write for ``rid`` landed (``error`` empty) or one failed: cache or free its
        pages on every rank at this same step; rank 0 answers the Prefill call (``on_settled``)."""
        ended = self.written.pop(rid)
        task = self.finishing.pop(rid, None)
        if task is not None:
            task.cancel()
        out = self.transfers.pop(rid, None)
        if out is not None:
            out.transfer.cancel()  # no-op once complete
        req = self.scheduler.request(rid)
        self.scheduler.prefill_sent(rid, ok=not error, error=error)
        if req is not None:
            seconds = time.monotonic() - out.prefilled_at if out is not None else 0.0
            self.on_settled(req, error, sum(e.nbytes for e in ended.values()), seconds)

    # ---- after each schedule ----------------------------------------------------------------
    def start(self) -> None:
        """After each schedule (before the forward): stop transfers of requests that ended, send the
        pages of finished chunks, and finish the transfers of requests whose prefill is complete."""
        for rid in [rid for rid in self.transfers if self.scheduler.request(rid) is None]:
            self.transfers.pop(rid).transfer.cancel()
        if self.stream_chunks:
            for req, computed in self.scheduler.prefill_progress():
                self._send_ready_pages(req, computed // self.scheduler.page_size)
        for req in self.scheduler.pop_prefilled():
            self.written[req.rid] = {}
            out = self.transfers.get(req.rid)
            if out is None:
                self.loop.inputs.report(KVWritten(req.rid, self.tp.rank, "no KV transfer open for it", 0))
                continue
            out.prefilled_at = time.monotonic()
            self._send_ready_pages(req, len(req.pages))
            try:
                self._send_local_pages(req, out.transfer)
            except ValueError as e:
                out.transfer.fail(KVTransferError(str(e)))
            out.transfer.finish()
            self.finishing[req.rid] = asyncio.create_task(self._finish(req, out))

    def _send_ready_pages(self, req: Req, ready_pages: int) -> None:
        """Send the decode pages whose prompt pages ``< ready_pages`` are computed and not sent yet."""
        out = self.transfers.get(req.rid)
        if out is None:
            return
        start = req.route.kv_dst_start_page
        end = min(ready_pages - start, out.transfer.num_full)
        if end > out.sent_pages:
            out.transfer.send(req.pages[start + out.sent_pages : start + end], out.sent_pages)
            out.sent_pages = end

    def _send_local_pages(self, req: Req, transfer: KVFanout) -> None:
        """With an SWA pool, send the local-layer pages of the prompt's last pages (as many as the
        decode worker gave: those its first decode step's window reads), once the prompt is computed.

        Raises:
            ValueError: one of them holds no local page here.
        """
        if transfer.num_local:
            route = req.route
            end = route.kv_dst_start_page + len(route.kv_dst_pages)
            pages = req.pages[end - transfer.num_local : end]
            transfer.send_local(self.scheduler.ledger.swa.local_pages(pages))

    async def _finish(self, req: Req, out: Outbound) -> None:
        """Await the end of this rank's write of ``req``'s KV; report it (every rank learns it at the
        next step, where the pages are cached or freed). With one rank the call answers at once."""
        timeout = self.transfer_timeout_s
        if req.deadline:
            timeout = max(0.1, min(timeout, req.deadline - time.time()))
        try:
            nbytes = await out.transfer.wait(timeout)
            event = KVWritten(req.rid, self.tp.rank, "", nbytes)
        except asyncio.CancelledError:
            return
        except KVTransferError as e:
            logger.warning("KV write for %s failed: %s", req.rid, e, extra={"rid": req.rid})
            event = KVWritten(req.rid, self.tp.rank, str(e) or type(e).__name__, 0)
        self.finishing.pop(req.rid, None)
        if self.tp.size == 1:
            error = event.error and f"KV transfer failed: {event.error}"
            self.on_settled(req, error, event.nbytes, time.monotonic() - out.prefilled_at)
        self.loop.inputs.report(event)
        self.loop.wake()
