"""An outbound KV transfer: the handle a prefill scheduler holds for one request's pages.

Pages are added with ``send`` as they are computed and handed to the agent's ``KVSender`` thread;
the transfer completes once every group of pages it was given is written (see ``sender``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pdserve.kv_transfer.completion import Completion
from pdserve.kv_transfer.errors import KVTransferError, KVTransferTimeout
from pdserve.kv_transfer.head_map import HeadSlice
from pdserve.kv_transfer.layout import KVAgentInfo


class PostQueue(Protocol):
    """What a transfer hands its pages to: the agent's post thread (``sender.KVSender``)."""

    num_pages: int  # pages of this side's transfer space (a source page is below it)
    local_offset: int  # the first page of the local layers' pool in that space

    def enqueue(self, transfer: KVTransfer, src: list[int], first: int) -> None:
        """Post ``src`` (local pages) for ``transfer.dst_pages[first:]``; ``group_left`` reports back."""

    def notify_abort(self, peer_name: str, tid: bytes) -> None:
        """Tell the receiver that transfer ``tid`` ended without its pages."""


class KVTransfer:
    """One outbound transfer into a peer's ``dst_pages`` (made by ``KVTransferAgent.start_transfer``).

    ``send`` any number of times, then ``finish``; ``wait`` returns once every byte has been written.
    A transfer that fails or is cancelled settles (``wait`` raises, the receiver gets its ABORT) only
    once every WRITE already posted has completed or failed: after that no byte of it lands, so the
    receiver may hand its pages on.

    Attributes:
        peer_name, tid: the receiver and the transfer id its notifications name.
        peer: the receiver's agent info (its pool's address and layout).
        dst_pages: the receiver's destination pages, in its transfer space
            (``KVAgentInfo.transfer_pages``): its pool's, then ``num_local`` of its local
            layers' pool.
        heads: the heads it moves of each page (``head_map``), or None for whole pages.
        nbytes: bytes written so far.
        descriptors: NIXL descriptors posted so far (one per run of pages consecutive on both sides;
            with ``heads``, one per ``(page, layer, kv, slot)`` row).
    """

    def __init__(
        self,
        sender: PostQueue,
        peer: KVAgentInfo,
        tid: bytes,
        dst_pages: Sequence[int],
        stall_s: float,
        num_local: int = 0,
        heads: HeadSlice | None = None,
    ):
        self.peer_name = peer.agent_name
        self.heads = heads
        self.num_local = num_local
        self.tid = tid
        self.dst_pages = np.asarray(dst_pages, dtype=np.int64)
        self.nbytes = 0
        self.descriptors = 0
        self.stall_s = stall_s
        self.lock = threading.Lock()  # held while pool pages of this transfer are read (a post)
        self._state = threading.Lock()  # the counters below: send() never waits for a post's copy
        self.peer = peer
        self._sender = sender
        self._pending = 0  # groups queued or in flight
        self._finished = False
        self._closed = False  # failed, cancelled or complete: no page is read any more
        self._error: BaseException | None = None
        self._completion = Completion()

    @property
    def num_full(self) -> int:
        """Destinations in the receiver's pool (the first ones; the local layers' pool's follow)."""
        return len(self.dst_pages) - self.num_local

    def send(self, src_pages: Sequence[int], first: int) -> None:
        """Queue our pool's pages ``src_pages[i]`` for the receiver's ``dst_pages[first + i]``.

        Raises:
            ValueError: a page out of range, ``first`` out of range, or ``send`` after ``finish``.
        """
        self._send([int(p) for p in src_pages], first, self.num_full, 0, self._sender.local_offset)

    def send_local(self, src_pages: Sequence[int]) -> None:
        """Queue our local layers' pages ``src_pages[i]`` (of ``SWAKVPool.swa``) for the receiver's
        local destinations, in order (``ValueError`` as ``send``)."""
        if len(src_pages) != self.num_local:
            raise ValueError(f"{len(src_pages)} local pages for {self.num_local} local destinations")
        offset, first = self._sender.local_offset, self.num_full
        src = [offset + int(p) for p in src_pages]
        self._send(src, first, len(self.dst_pages), offset, self._sender.num_pages)

    def _send(self, src: list[int], first: int, end: int, low: int, high: int) -> None:
        """Queue ``src`` (transfer-space pages in ``[low, high)``) for ``dst_pages[first:end]``."""
        if not src:
            return
        if self._finished:
            raise ValueError("send() after finish()")
        if first < 0 or first + len(src) > end:
            raise ValueError(f"destinations [{first}, {first + len(src)}) outside [0, {end})")
        if min(src) < low or max(src) >= high:
            raise ValueError(f"a source page is outside [{low}, {high})")
        with self._state:
            if self._closed:
                return
            self._pending += 1
        self._sender.enqueue(self, src, first)

    def finish(self) -> None:
        """No more ``send`` calls; the transfer completes once what was sent is written."""
        with self._state:
            self._finished = True
            complete = self._pending == 0 and not self._closed
            if complete:
                self._closed = True
        if complete:
            self._completion.set_result(self.nbytes)

    async def wait(self, timeout_s: float) -> int:
        """Bytes written, once every page sent is written (after ``finish``).

        Raises:
            KVTransferError: a WRITE failed, the peer is gone, or the transfer was cancelled.
            KVTransferTimeout: not done within ``timeout_s`` (the transfer is then cancelled).
        """
        try:
            return await self._completion.wait(timeout_s)
        except TimeoutError:
            self.cancel()
            with contextlib.suppress(Exception):  # the WRITEs in flight end by their own stall bound
                await self._completion.wait(self.stall_s + 1)
            raise KVTransferTimeout(f"KV transfer {self.tid!r} to {self.peer_name!r} timed out") from None

    def cancel(self) -> None:
        """Stop: once this returns no page of this transfer is read (the WRITEs in flight still land or
        fail before it settles). Idempotent; the receiver is told."""
        self.fail(KVTransferError(f"KV transfer {self.tid!r} to {self.peer_name!r} cancelled"))

    @property
    def done(self) -> bool:
        return self._completion.done

    @property
    def is_open(self) -> bool:
        return not self._closed

    def group_left(self, nbytes: int, descriptors: int) -> None:
        """A group left the sender's pipeline: written (its bytes and descriptors), or dropped or
        failed (zeros). Called by the sender's post thread."""
        with self._state:
            self.nbytes += nbytes
            self.descriptors += descriptors
            self._pending -= 1
            complete = self._pending == 0 and self._finished and not self._closed
            if complete:
                self._closed = True
            settle_failure = self._pending == 0 and self._error is not None
        if complete:
            self._completion.set_result(self.nbytes)
        elif settle_failure:
            self._settle_failure()

    def fail(self, error: BaseException) -> None:
        """End with ``error`` unless already ended; settles (and tells the receiver: ABORT) once no
        WRITE of it is in flight."""
        with self.lock, self._state:  # after a post in progress: then no page of it is read any more
            if self._closed:
                return
            self._closed, self._error = True, error
            drained = self._pending == 0
        if drained:
            self._settle_failure()

    def _settle_failure(self) -> None:
        if self._completion.set_exception(self._error):
            self._sender.notify_abort(self.peer_name, self.tid)
