"""One NIXL agent per scheduler process: registers the KV pool, knows its peers, WRITEs page lists.

The prefill side WRITEs the KV pages of a request into the decode side's pages (one-sided, as in
Mooncake / SGLang's PD disaggregation over NIXL) and attaches a notification that the decode side awaits.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t, nixl_xfer_handle

from pdserve.kv_transfer.descriptors import coalesce, page_run_descs
from pdserve.kv_transfer.errors import NIXL_ERRORS, KVTransferError, KVTransferTimeout, PeerDisconnected
from pdserve.kv_transfer.layout import POOL_LAYOUT, KVAgentInfo, KVLayout, check_compatible
from pdserve.kv_transfer.notifications import NotificationPump

logger = logging.getLogger(__name__)

T = TypeVar("T")

_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.002


class KVTransferAgent:
    """A NIXL agent (UCX backend) with the whole KV pool ``kv_data`` registered once.

    Args:
        name: agent name, unique among all schedulers that will talk to each other.
        kv_data: the pool tensor ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]``,
            contiguous, in the model dtype, on CPU (NIXL ``DRAM``) or one CUDA device (``VRAM``).
        layout: its layout facts; they must agree with the tensor's shape and dtype.

    Raises:
        ValueError: ``kv_data`` does not match ``layout`` or is not contiguous.
        KVTransferError: NIXL could not create the agent or register the memory.

    Agent calls are serialized by NIXL (``NIXL_THREAD_SYNC_STRICT``), so the methods may be called from
    any thread; ``write_pages`` and ``wait_for_notification`` run on the caller's event loop.
    """

    def __init__(self, name: str, kv_data: torch.Tensor, layout: KVLayout):
        _check_pool(kv_data, layout)
        self.name = name
        self.layout = layout
        config = nixl_agent_config(
            enable_prog_thread=False,
            backends=["UCX"],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            self._agent = nixl_agent(name, config)
            if "UCX" not in self._agent.backends:
                raise KVTransferError("the NIXL UCX backend is not available")
            self._registration = self._agent.register_memory(kv_data)
            metadata = self._agent.get_agent_metadata()
        except NIXL_ERRORS as e:
            raise KVTransferError(f"cannot set up NIXL agent {name!r}: {e}") from e
        self._kv_data = kv_data  # keeps the registered memory alive
        self._info = KVAgentInfo(
            agent_name=name,
            agent_metadata=metadata,
            layout=layout,
            base_addr=kv_data.data_ptr(),
            num_bytes=kv_data.numel() * kv_data.element_size(),
            device_id=kv_data.get_device(),
            num_pages=kv_data.shape[2],
            incarnation=uuid.uuid4().hex,
        )
        self._peers: dict[str, KVAgentInfo] = {}
        self._notifications = NotificationPump(self._agent.get_new_notifs, name=f"nixl-progress-{name}")

    # ---- identity and peers -----------------------------------------------------------------
    def local_info(self) -> KVAgentInfo:
        """What a peer needs to write into (and be notified by) this agent."""
        return self._info

    def add_peer(self, info: KVAgentInfo) -> None:
        """Load a peer's metadata so this agent can WRITE into its pool; no-op if already known.

        A peer known under the same name with another incarnation (a restart) is replaced.

        Raises:
            KVLayoutMismatch: the peer's layout differs from ours (message names every field).
            KVTransferError: NIXL cannot load the metadata or connect (e.g. the peer is gone).
        """
        check_compatible(self.layout, info.layout)
        if info.agent_name == self.name:
            raise KVTransferError(f"peer {info.agent_name!r} has this agent's own name")
        known = self._peers.get(info.agent_name)
        if known is not None:
            if known.incarnation == info.incarnation:
                return
            self.remove_peer(info.agent_name)
        try:
            loaded = self._agent.add_remote_agent(info.agent_metadata)
        except NIXL_ERRORS as e:
            raise KVTransferError(f"cannot add KV peer {info.agent_name!r}: {e}") from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != info.agent_name:
            self._agent.remove_remote_agent(loaded)
            raise KVTransferError(f"metadata of peer {info.agent_name!r} names agent {loaded!r}")
        self._peers[info.agent_name] = info

    def has_peer(self, name: str, incarnation: str | None = None) -> bool:
        """Whether ``name`` is a loaded peer (of that incarnation, when given)."""
        info = self._peers.get(name)
        return info is not None and incarnation in (None, info.incarnation)

    def remove_peer(self, name: str) -> None:
        """Forget a peer and disconnect from it; unknown names are ignored."""
        if self._peers.pop(name, None) is None:
            return
        try:
            self._agent.remove_remote_agent(name)
        except NIXL_ERRORS as e:
            logger.warning("removing KV peer %r: %s", name, e)

    # ---- sender side --------------------------------------------------------------------------
    def begin_write(
        self,
        peer_name: str,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        notif: bytes,
        timeout_s: float,
    ) -> KVWrite:
        """Post a WRITE of our pages ``src_pages[i]`` into the peer's ``dst_pages[i]``, every layer and k/v.

        Runs consecutive on both sides become one descriptor per (layer, k/v) plane. The peer receives
        ``notif`` once every byte has landed (with no pages, ``notif`` is sent on its own). Drive the
        returned ``KVWrite`` with ``poll()``; ``write_pages`` does that on an event loop.

        Raises:
            ValueError: lists of different length, a repeated destination page, or a page out of range.
            KVTransferError: unknown peer, or NIXL refused the transfer (a dead peer is forgotten).
        """
        peer = self._peers.get(peer_name)
        if peer is None:
            raise KVTransferError(f"unknown KV peer {peer_name!r}: add_peer() it first")
        runs = np.array(coalesce(src_pages, dst_pages), dtype=np.int64).reshape(-1, 3)
        _check_range("source", runs[:, 0], runs[:, 2], self._info.num_pages)
        _check_range("destination", runs[:, 1], runs[:, 2], peer.num_pages)
        deadline = time.monotonic() + timeout_s
        if len(runs) == 0:
            self._call(peer_name, self._agent.send_notif, peer_name, notif)
            return KVWrite(self._call, self._agent, peer_name, None, 0, deadline)
        local = page_run_descs(self._info, runs[:, 0], runs[:, 2])
        remote = page_run_descs(peer, runs[:, 1], runs[:, 2])
        handle = self._call(
            peer_name,
            self._agent.initialize_xfer,
            "WRITE",
            self._agent.get_xfer_descs(local, self._info.mem_type),
            self._agent.get_xfer_descs(remote, peer.mem_type),
            peer_name,
            notif,
        )
        return KVWrite(self._call, self._agent, peer_name, handle, int(local[:, 1].sum()), deadline)

    async def write_pages(
        self,
        peer_name: str,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        notif: bytes,
        timeout_s: float,
    ) -> int:
        """``begin_write`` and await completion, polling with 0.5 ms → 2 ms backoff; returns bytes written.

        The transfer is aborted (handle released) on error, timeout and cancellation alike.

        Raises:
            ValueError, KVTransferError: as ``begin_write``; KVTransferError also on a failed transfer.
            KVTransferTimeout: not complete within ``timeout_s`` seconds.
        """
        write = self.begin_write(peer_name, src_pages, dst_pages, notif, timeout_s)
        try:
            delay = _POLL_MIN_S
            while not write.poll():
                await asyncio.sleep(delay)
                delay = min(2 * delay, _POLL_MAX_S)
        finally:
            write.release()
        return write.nbytes

    # ---- receiver side ------------------------------------------------------------------------
    def poll_notifications(self) -> list[bytes]:
        """Notification messages from all peers that no ``wait_for_notification`` claimed, oldest first."""
        return self._notifications.drain()

    async def wait_for_notification(self, msg: bytes, timeout_s: float) -> None:
        """Return once a peer's notification ``msg`` arrived (before or during the call).

        Raises:
            KVTransferTimeout: not within ``timeout_s`` seconds.
            KVTransferError: the agent was closed meanwhile.
        """
        await self._notifications.wait(msg, timeout_s)

    def close(self) -> None:
        """Stop the progress thread, fail pending waits, disconnect peers and deregister the pool."""
        self._notifications.close()
        for name in list(self._peers):
            self.remove_peer(name)
        try:
            self._agent.deregister_memory(self._registration)
        except NIXL_ERRORS as e:
            logger.warning("deregistering the KV pool of %r: %s", self.name, e)

    def _call(self, peer_name: str, fn: Callable[..., T], *args: Any) -> T:
        """Call into NIXL for a transfer to ``peer_name``; NIXL errors become ``KVTransferError``."""
        try:
            return fn(*args)
        except PeerDisconnected as e:
            self.remove_peer(peer_name)
            raise KVTransferError(f"KV peer {peer_name!r} disconnected: {e}") from e
        except NIXL_ERRORS as e:
            raise KVTransferError(f"KV transfer to {peer_name!r} failed: {e}") from e


class KVWrite:
    """One NIXL WRITE, posted on construction: ``poll()`` until it returns True, or ``release()`` to abort.

    Made by ``KVTransferAgent.begin_write``; ``handle=None`` stands for a write with nothing to move.

    Attributes:
        peer_name: destination agent.
        nbytes: bytes the WRITE moves.
    """

    def __init__(
        self,
        call: Callable[..., Any],
        nixl: nixl_agent,
        peer_name: str,
        handle: nixl_xfer_handle | None,
        nbytes: int,
        deadline: float,
    ):
        self._call = call  # KVTransferAgent._call: NIXL errors -> KVTransferError
        self._nixl = nixl
        self._handle = handle
        self._deadline = deadline
        self._state = "PROC" if handle is not None else "DONE"
        self.peer_name = peer_name
        self.nbytes = nbytes
        if handle is None:
            return
        try:
            self._state = self._call(peer_name, nixl.transfer, handle)
            self._raise_on_error()
        except BaseException:
            self.release()
            raise

    def poll(self) -> bool:
        """True once every byte landed (the handle is then released).

        Raises:
            KVTransferError: the transfer failed. KVTransferTimeout: its deadline passed.
            Either way the handle is released (the transfer aborted).
        """
        if self._state == "PROC":
            self._state = self._call(self.peer_name, self._nixl.check_xfer_state, self._handle)
        try:
            self._raise_on_error()
            if self._state == "PROC" and time.monotonic() > self._deadline:
                raise KVTransferTimeout(f"KV write of {self.nbytes} bytes to {self.peer_name!r} timed out")
        except KVTransferError:
            self.release()
            raise
        if self._state == "DONE":
            self.release()
        return self._state == "DONE"

    def release(self) -> None:
        """Free the NIXL handle; a transfer still in flight is cancelled (later polls fail). Idempotent."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        if self._state == "PROC":
            self._state = "ERR"
        try:
            handle.release()
        except NIXL_ERRORS as e:
            logger.warning("releasing KV write handle to %r: %s", self.peer_name, e)

    def _raise_on_error(self) -> None:
        if self._state == "ERR":
            raise KVTransferError(f"KV write of {self.nbytes} bytes to {self.peer_name!r} failed or aborted")


def _check_pool(kv_data: torch.Tensor, layout: KVLayout) -> None:
    if layout.layout != POOL_LAYOUT:
        raise ValueError(f"unsupported KV pool layout {layout.layout!r}; expected {POOL_LAYOUT!r}")
    expected = (layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
    shape = tuple(kv_data.shape)
    if len(shape) != 6 or shape[:2] + shape[3:] != expected:
        raise ValueError(f"kv_data shape {shape} does not match [L, 2, pages, slot, head, dim] = {expected}")
    if str(kv_data.dtype).removeprefix("torch.") != layout.dtype:
        raise ValueError(f"kv_data dtype {kv_data.dtype} does not match layout dtype {layout.dtype!r}")
    if not kv_data.is_contiguous():
        raise ValueError("kv_data must be contiguous")


def _check_range(side: str, starts: np.ndarray, counts: np.ndarray, num_pages: int) -> None:
    if len(starts) and (starts.min() < 0 or (starts + counts).max() > num_pages):
        raise ValueError(f"a {side} page is outside [0, {num_pages})")
