"""Sending side of KV transfers: a post thread per agent that WRITEs groups of pages and polls them.

A transfer's pages are sent in groups, as ``send`` calls add them (a chunked prefill adds each chunk's
finished pages while the next chunk computes). A group is one NIXL WRITE straight into the
destination pages, one descriptor per run of pages consecutive on both sides (the page-major pool
holds a page of every layer in one byte range), carrying a LANDED notification. Groups are posted
as they come, without waiting for earlier ones to complete.

A WRITE reads pool pages (on CPU inside the post itself), so posts run under the transfer's lock and
only while it is open: once ``cancel`` returns its source pages may be freed and reused.
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
from pdserve.kv_transfer.descriptors import coalesce, head_slice_descs, page_run_descs
from pdserve.kv_transfer.errors import KVTransferError, KVTransferTimeout
from pdserve.kv_transfer.layout import KVAgentInfo
from pdserve.kv_transfer.transfer import KVTransfer

logger = logging.getLogger(__name__)

_POLL_S = 0.0002


@dataclass
class _Group:
    transfer: KVTransfer
    src: list[int]
    first: int  # index of src[0]'s destination in transfer.dst_pages
    handle: Any = None  # the NIXL WRITE in flight
    state: str = ""
    deadline: float = 0.0
    nbytes: int = 0
    descriptors: int = 0


_IDLE = _Group(None, [], 0)  # type: ignore[arg-type]  # the post queue had nothing within _POLL_S


def _release(group: _Group) -> None:
    """Release a WRITE's handle. NIXL refuses to release one still in progress (a stalled WRITE whose
    peer hangs): that handle is left to the agent's teardown, and the post thread goes on."""
    try:
        group.handle.release()
    except Exception as e:
        t = group.transfer
        logger.warning("KV write of %r to %r not released: %s", t.tid, t.peer_name, e)
    group.handle = None


class KVSender:
    """The post thread of one agent.

    Args:
        call: runs a NIXL call for a peer, turning NIXL errors into ``KVTransferError``.
        nixl: the NIXL agent.
        local: this agent's info (pool address, device).
    """

    def __init__(self, call: Callable[..., Any], nixl: Any, local: KVAgentInfo):
        self._call = call
        self._nixl = nixl
        self._local = local
        self.num_pages = local.num_transfer_pages
        self.local_offset = local.num_pages
        self._post_q: queue.SimpleQueue[_Group | None] = queue.SimpleQueue()
        self._active = 0  # groups queued or in flight
        self._active_lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._post_loop, name=f"kv-post-{local.agent_name}", daemon=True
        )
        self._thread.start()

    def enqueue(self, transfer: KVTransfer, src: list[int], first: int) -> None:
        """Queue one WRITE of our pages ``src`` into the receiver's ``dst_pages[first:]``."""
        with self._active_lock:
            self._active += 1
        self._post_q.put(_Group(transfer, src, first))

    def busy(self) -> bool:
        return self._active > 0

    def notify_abort(self, peer_name: str, tid: bytes) -> None:
        try:
            self._call(peer_name, self._nixl.send_notif, peer_name, messages.abort(tid))
        except KVTransferError as e:
            logger.info("telling %r that KV transfer %r aborted: %s", peer_name, tid, e)

    def close(self) -> None:
        self._post_q.put(None)
        self._thread.join(5)

    # ---- the post thread ----------------------------------------------------------------------
    def _post_loop(self) -> None:
        """Post each group's WRITE as it comes, without waiting for the previous one to complete
        (completion waits for the receiver's progress), and poll the ones in flight."""
        inflight: list[_Group] = []
        while True:
            try:
                group = self._post_q.get(timeout=_POLL_S if inflight else None)
            except queue.Empty:
                group = _IDLE
            if group is None:
                break
            if group is not _IDLE and not self._guard(group, self._post):
                inflight.append(group)
            inflight = [g for g in inflight if not self._guard(g, self._poll)]
        for group in inflight:
            _release(group)

    def _guard(self, group: _Group, step: Callable[[_Group], bool]) -> bool:
        """Run ``step``; True when the group left the pipeline (written, skipped, or failed)."""
        try:
            return step(group)
        except Exception as e:  # any failure fails this transfer, not the thread
            if not isinstance(e, KVTransferError):
                logger.exception("KV transfer %r: unexpected error", group.transfer.tid)
                e = KVTransferError(f"KV transfer {group.transfer.tid!r} failed: {e}")
            if group.handle is not None:
                _release(group)
            group.transfer.fail(e)
            return self._leave(group, written=False)

    def _post(self, group: _Group) -> bool:
        """Post the group's WRITE (one descriptor per run of pages) with its LANDED notification."""
        t, nixl = group.transfer, self._nixl
        dst = t.dst_pages[group.first : group.first + len(group.src)]
        local, remote = self._descs(group.src, dst, t)
        group.nbytes = int(local[:, 1].sum())
        group.descriptors = len(local)
        notif = messages.landed(t.tid, group.first, len(group.src))
        local_descs = nixl.get_xfer_descs(local, self._local.mem_type)
        remote_descs = nixl.get_xfer_descs(remote, t.peer.mem_type)
        with t.lock:  # the WRITE reads pool pages (on CPU, inside the post itself)
            posted = t.is_open
            if posted:
                group.handle = self._call(
                    t.peer_name, nixl.initialize_xfer, "WRITE", local_descs, remote_descs, t.peer_name, notif
                )
                group.deadline = time.monotonic() + t.stall_s
                group.state = self._call(t.peer_name, nixl.transfer, group.handle)
        return self._poll(group) if posted else self._leave(group, written=False)

    def _descs(self, src: list[int], dst: np.ndarray, t: KVTransfer) -> tuple[np.ndarray, np.ndarray]:
        """The WRITE's local and remote descriptors: one per run of whole pages, or with ``t.heads``
        one per row of each page's head slice (``head_slice_descs``)."""
        if t.heads is not None:
            heads = t.heads
            local = head_slice_descs(
                self._local, np.asarray(src, dtype=np.int64), heads.src_head, heads.num_heads
            )
            return local, head_slice_descs(t.peer, dst, heads.dst_head, heads.num_heads)
        runs = coalesce(src, dst.tolist(), self._local.num_pages, t.peer.num_pages)
        runs = np.array(runs, dtype=np.int64).reshape(-1, 3)
        return page_run_descs(self._local, runs[:, 0], runs[:, 2]), page_run_descs(
            t.peer, runs[:, 1], runs[:, 2]
        )

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
        _release(group)
        return self._leave(group, written=True)

    def _leave(self, group: _Group, written: bool) -> bool:
        """The group leaves the pipeline: written, or failed or skipped (nothing of it in flight)."""
        with self._active_lock:
            self._active -= 1
        group.transfer.group_left(group.nbytes * written, group.descriptors * written)
        return True
