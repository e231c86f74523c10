"""Sending side of KV transfers: a gather thread and a post thread per agent, as a two-stage pipeline.

A transfer's pages are sent in groups, as ``send`` calls add them (a chunked prefill adds each chunk's
finished pages while the next chunk computes). A group whose pages form few runs that are consecutive
on both sides (descriptors of ``StagingConfig.direct_min_bytes`` or more) is one WRITE straight into
the destination pages. Any other group is split into slots: the gather thread copies a slot's pages out
of the pool into a send slot while the post thread WRITEs the previous slot, as one descriptor, into
a slot of the receiver's lane, so the copy overlaps the wire and the descriptor count no longer grows
with the number of scattered pages. Each WRITE carries a LANDED notification; the receiver ACKs lane
slots once it has scattered them.

Page reads (the gather, a direct WRITE on CPU) run under the transfer's lock and only while it is
open, so once ``cancel`` returns its source pages may be freed and reused.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.kv_transfer import messages
from pdserve.kv_transfer.descriptors import coalesce, page_run_descs
from pdserve.kv_transfer.errors import KVTransferError, KVTransferTimeout
from pdserve.kv_transfer.layout import KVAgentInfo
from pdserve.kv_transfer.page_copy import PageCopier
from pdserve.kv_transfer.staging import SlotRing, StagingArea
from pdserve.kv_transfer.transfer import KVTransfer

logger = logging.getLogger(__name__)

_POLL_S = 0.0002


@dataclass
class _Group:
    transfer: KVTransfer
    src: list[int]
    first: int  # index of src[0]'s destination in transfer.dst_pages
    staged: bool
    send_slot: int = -1  # our slot holding the gathered pages
    lane_slot: int = -1  # the receiver's slot they are written into
    handle: Any = None  # the NIXL WRITE in flight
    state: str = ""
    deadline: float = 0.0
    nbytes: int = 0
    descriptors: int = 0


_NO_GROUP = _Group(None, [], 0, False)  # type: ignore[arg-type]


class KVSender:
    """The gather and post threads of one agent.

    Args:
        call: runs a NIXL call for a peer, turning NIXL errors into ``KVTransferError``.
        nixl: the NIXL agent.
        local: this agent's info (pool address, device).
        staging: this agent's staging memory (its send slots).
        copier: gathers pages into send slots.
        pump: fetches notifications now (ACKs free lane slots).
    """

    def __init__(
        self,
        call: Callable[..., Any],
        nixl: Any,
        local: KVAgentInfo,
        staging: StagingArea,
        copier: PageCopier,
        pump: Callable[[], None],
    ):
        self._call = call
        self._nixl = nixl
        self._local = local
        self.staging = staging
        self.copier = copier
        self._pump = pump
        self._send_slots = SlotRing(staging.send_slots)
        self._gather_q: queue.SimpleQueue[_Group | None] = queue.SimpleQueue()
        self._post_q: queue.SimpleQueue[_Group | None] = queue.SimpleQueue()
        self._active = 0  # groups in the pipeline
        self._active_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=loop, name=f"kv-{kind}-{local.agent_name}", daemon=True)
            for kind, loop in (("gather", self._gather_loop), ("post", self._post_loop))
        ]
        for thread in self._threads:
            thread.start()

    def plan(self, transfer: KVTransfer, src: list[int], first: int) -> list[_Group]:
        """Split pages into one direct group (few runs, or no usable lane) or slot-sized staged groups
        (as many pages as both our send slots and the receiver's lane slots hold)."""
        dst = transfer.dst_pages[first : first + len(src)].tolist()
        peer = transfer.link.info
        k = min(self.staging.pages_per_slot, peer.staging_slot_bytes // self.copier.span_bytes)
        run_bytes = len(src) * self.copier.span_bytes / len(coalesce(src, dst)) / self.copier.planes
        if transfer.link.lane is None or k < 1 or run_bytes >= self.staging.direct_min_bytes:
            return [_Group(transfer, src, first, staged=False)]
        return [_Group(transfer, src[i : i + k], first + i, staged=True) for i in range(0, len(src), k)]

    def enqueue(self, group: _Group) -> None:
        with self._active_lock:
            self._active += 1
        (self._gather_q if group.staged else self._post_q).put(group)

    def busy(self) -> bool:
        return self._active > 0

    def notify_abort(self, peer_name: str, tid: bytes) -> None:
        try:
            self._call(peer_name, self._nixl.send_notif, peer_name, messages.abort(tid))
        except KVTransferError as e:
            logger.info("telling %r that KV transfer %r aborted: %s", peer_name, tid, e)

    def close(self) -> None:
        self._gather_q.put(None)
        self._post_q.put(None)
        for thread in self._threads:
            thread.join(5)

    # ---- threads ----------------------------------------------------------------------------
    def _gather_loop(self) -> None:
        while (group := self._gather_q.get()) is not None:
            self._guard(group, self._gather)

    def _post_loop(self) -> None:
        """Post each group's WRITE as it comes, without waiting for the previous one to complete
        (completion waits for the receiver's progress), and poll the ones in flight."""
        inflight: list[_Group] = []
        while True:
            try:
                group = self._post_q.get(timeout=_POLL_S if inflight else None)
            except queue.Empty:
                group = _NO_GROUP
            if group is None:
                break
            if group is not _NO_GROUP and not self._guard(group, self._post):
                inflight.append(group)
            inflight = [g for g in inflight if not self._guard(g, self._poll)]
        for group in inflight:
            group.handle.release()

    def _guard(self, group: _Group, step: Callable[[_Group], bool]) -> bool:
        """Run ``step``; True when the group left the pipeline (written, skipped, or failed)."""
        try:
            return step(group)
        except Exception as e:  # any failure fails this transfer, not the thread
            if not isinstance(e, KVTransferError):
                logger.exception("KV transfer %r: unexpected error", group.transfer.tid)
                e = KVTransferError(f"KV transfer {group.transfer.tid!r} failed: {e}")
            if group.handle is not None:
                group.handle.release()
            if group.lane_slot >= 0 and not isinstance(e, KVTransferTimeout):
                group.transfer.link.lane.release(group.lane_slot)  # not announced: no ACK will come
            self._drop(group)
            group.transfer.fail(e)
            return True

    def _gather(self, group: _Group) -> bool:
        t = group.transfer
        if not t.is_open:
            return self._drop(group)
        group.send_slot = self._send_slots.acquire(time.monotonic() + t.stall_s, what="send slot")
        with t.lock:
            if not t.is_open:
                return self._drop(group)
            self.copier.gather(group.src, self.staging.slot(group.send_slot))
        self._post_q.put(group)
        return False

    def _post(self, group: _Group) -> bool:
        t = group.transfer
        if not t.is_open:
            return self._drop(group)
        peer = t.link.info
        if group.staged:
            lane = t.link.lane
            what = f"receive slot of {t.peer_name!r}"
            group.lane_slot = lane.acquire(time.monotonic() + t.stall_s, self._pump, what=what)
            group.nbytes = len(group.src) * self.copier.span_bytes
            local = _one_desc(self.staging.addr(group.send_slot), group.nbytes, self._local.device_id)
            addr = peer.staging_addr + group.lane_slot * peer.staging_slot_bytes
            remote = _one_desc(addr, group.nbytes, peer.device_id)
            self._start_write(group, local, remote, group.lane_slot)
        else:
            dst = t.dst_pages[group.first : group.first + len(group.src)].tolist()
            runs = np.array(coalesce(group.src, dst), dtype=np.int64).reshape(-1, 3)
            local = page_run_descs(self._local, runs[:, 0], runs[:, 2])
            remote = page_run_descs(peer, runs[:, 1], runs[:, 2])
            group.nbytes = int(local[:, 1].sum())
            with t.lock:  # the WRITE reads pool pages (on CPU, inside the post itself)
                if not t.is_open:
                    return self._drop(group)
                self._start_write(group, local, remote, messages.DIRECT)
        return self._poll(group)

    def _start_write(self, group: _Group, local: np.ndarray, remote: np.ndarray, slot: int) -> None:
        """Post one NIXL WRITE carrying the group's LANDED notification."""
        t, nixl = group.transfer, self._nixl
        notif = messages.landed(t.tid, group.first, len(group.src), slot)
        local_descs = nixl.get_xfer_descs(local, self._local.mem_type)
        remote_descs = nixl.get_xfer_descs(remote, t.link.info.mem_type)
        group.handle = self._call(
            t.peer_name, nixl.initialize_xfer, "WRITE", local_descs, remote_descs, t.peer_name, notif
        )
        group.descriptors = len(local)
        group.deadline = time.monotonic() + t.stall_s
        group.state = self._call(t.peer_name, nixl.transfer, group.handle)

    def _poll(self, group: _Group) -> bool:
        """True once the group's WRITE is complete (the group is then done)."""
        t = group.transfer
        if group.state == "PROC":
            group.state = self._call(t.peer_name, self._nixl.check_xfer_state, group.handle)
        if group.state == "PROC":
            if time.monotonic() > group.deadline:
                raise KVTransferTimeout(f"KV write to {t.peer_name!r} stalled for {t.stall_s:.3g} s")
            return False
        if group.state != "DONE":
            raise KVTransferError(f"KV write to {t.peer_name!r} failed")
        group.handle.release()
        group.handle = None
        self._drop(group)
        t.group_done(group.nbytes, group.descriptors)
        return True

    def _drop(self, group: _Group) -> bool:
        """The group leaves the pipeline (written, failed or skipped): give its send slot back."""
        if group.send_slot >= 0:
            self._send_slots.release(group.send_slot)
            group.send_slot = -1
        with self._active_lock:
            self._active -= 1
        return True


def _one_desc(addr: int, nbytes: int, device_id: int) -> np.ndarray:
    return np.array([[addr, nbytes, max(device_id, 0)]], dtype=np.uint64)
