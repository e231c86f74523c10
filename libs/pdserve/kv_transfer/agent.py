"""One NIXL agent per scheduler process: registers the KV pool, knows its peers, sends and receives KV
transfers.

The prefill side WRITEs the KV pages of a request straight into the decode side's pages (one-sided, as
in Mooncake / SGLang's PD disaggregation over NIXL), one descriptor per run of pages (see ``sender``);
the decode side completes a transfer once every page has landed (see ``receiver``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from pdserve.kv_transfer import messages
from pdserve.kv_transfer.errors import NIXL_ERRORS, KVTransferError, PeerDisconnected
from pdserve.kv_transfer.head_map import HeadSlice
from pdserve.kv_transfer.layout import POOL_LAYOUT, KVAgentInfo, KVLayout, check_compatible
from pdserve.kv_transfer.notifications import NotificationPump
from pdserve.kv_transfer.receiver import KVReceive, KVReceiver
from pdserve.kv_transfer.sender import KVSender
from pdserve.kv_transfer.transfer import KVTransfer

logger = logging.getLogger(__name__)


def _route_nixl_logs() -> None:
    """Send nixl's records through this process's logging (``--log-format``, rid): importing
    ``nixl._api`` gives the "nixl" logger a stdout handler of its own line format, not propagated."""
    nixl_logger = logging.getLogger("nixl")
    for handler in list(nixl_logger.handlers):
        nixl_logger.removeHandler(handler)
    nixl_logger.propagate = True


_route_nixl_logs()

T = TypeVar("T")


class KVTransferAgent:
    """A NIXL agent (UCX backend) with the KV pool ``kv_data`` registered once.

    Args:
        name: agent name, unique among all schedulers that will talk to each other.
        kv_data: the pool tensor ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``,
            contiguous, in the model dtype, on CPU (NIXL ``DRAM``) or one CUDA device (``VRAM``).
        layout: its layout facts; they must agree with the tensor's shape and dtype.
        local_kv_data: with ``layout.num_local_layers``, the local layers' pool (``SWAKVPool.swa``), laid
            out as ``kv_data`` with their layers, registered beside it.

    Raises:
        ValueError: ``kv_data`` does not match ``layout`` or is not contiguous.
        KVTransferError: NIXL could not create the agent or register the memory.

    Agent calls are serialized by NIXL (``NIXL_THREAD_SYNC_STRICT``), so the methods may be called from
    any thread; ``KVTransfer.wait`` and ``KVReceive.wait`` run on the caller's event loop.
    """

    def __init__(
        self, name: str, kv_data: torch.Tensor, layout: KVLayout, local_kv_data: torch.Tensor | None = None
    ):
        _check_pool(kv_data, layout, layout.num_layers - layout.num_local_layers)
        if layout.num_local_layers or local_kv_data is not None:
            if local_kv_data is None:
                raise ValueError("a layout with local layers needs their pool (local_kv_data)")
            _check_pool(local_kv_data, layout, layout.num_local_layers)
        pools = [t for t in (kv_data, local_kv_data) if t is not None and t.numel()]
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
            self._registration = self._agent.register_memory(pools)
            metadata = self._agent.get_agent_metadata()
        except NIXL_ERRORS as e:
            raise KVTransferError(f"cannot set up NIXL agent {name!r}: {e}") from e
        self._kv_data = pools  # keeps the registered memory alive
        local = {}
        if local_kv_data is not None:
            local = dict(
                local_base_addr=local_kv_data.data_ptr(),
                local_num_bytes=local_kv_data.numel() * local_kv_data.element_size(),
                local_num_pages=local_kv_data.shape[0],
            )
        self._info = KVAgentInfo(
            agent_name=name,
            agent_metadata=metadata,
            layout=layout,
            base_addr=kv_data.data_ptr(),
            num_bytes=kv_data.numel() * kv_data.element_size(),
            device_id=kv_data.get_device(),
            num_pages=kv_data.shape[0],
            incarnation=uuid.uuid4().hex,
            **local,
        )
        self._peers: dict[str, KVAgentInfo] = {}
        page_bytes = lambda pages: self._info.page_addrs(pages)[1]
        self._receiver = KVReceiver(page_bytes, kick=lambda: self._pump.kick())
        self._sender = KVSender(self._call, self._agent, self._info)
        self._pump = NotificationPump(
            self._agent.get_new_notifs, self._on_notification, self._busy, name=f"nixl-progress-{name}"
        )

    # ---- identity and peers -----------------------------------------------------------------
    def local_info(self) -> KVAgentInfo:
        """What a peer needs to write into this agent."""
        return self._info

    def add_peer(self, info: KVAgentInfo) -> None:
        """Load a peer's metadata so this agent can WRITE into it; no-op if already known.

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
            logger.info("KV peer %r restarted: its new incarnation replaces the old one", info.agent_name)
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
        peer = self._peers.get(name)
        return peer is not None and incarnation in (None, peer.incarnation)

    def remove_peer(self, name: str) -> None:
        """Forget a peer and disconnect from it; unknown names are ignored."""
        if self._peers.pop(name, None) is None:
            return
        try:
            self._agent.remove_remote_agent(name)
        except NIXL_ERRORS as e:
            logger.warning("removing KV peer %r: %s", name, e)

    # ---- sender side --------------------------------------------------------------------------
    def start_transfer(
        self,
        peer_name: str,
        tid: bytes,
        dst_pages: Sequence[int],
        stall_s: float,
        dst_local_pages: Sequence[int] = (),
        heads: HeadSlice | None = None,
    ) -> KVTransfer:
        """Open a transfer into the peer's ``dst_pages`` (of its pool) and ``dst_local_pages`` (of its
        local layers' pool); ``send`` / ``send_local`` pages into it as they are ready.

        ``stall_s`` bounds each WRITE's wait for completion. ``heads``: move only that slice of each
        page's KV heads (``head_map``; no local layers' pages then), else whole pages.

        Raises:
            KVTransferError: unknown peer. ValueError: a destination page repeated or out of range, or
                a head slice outside either pool's heads.
        """
        peer = self._peers.get(peer_name)
        if peer is None:
            raise KVTransferError(f"unknown KV peer {peer_name!r}: add_peer() it first")
        if heads is not None and (
            dst_local_pages
            or min(heads) < 0
            or heads.src_head + heads.num_heads > self.layout.num_kv_heads
            or heads.dst_head + heads.num_heads > peer.layout.num_kv_heads
        ):
            raise ValueError(f"head slice {heads} does not fit both pools (or local layers' pages given)")
        for pages, limit in ((dst_pages, peer.num_pages), (dst_local_pages, peer.local_num_pages)):
            if len(set(pages)) != len(pages):
                raise ValueError("a destination page appears more than once")
            if pages and (min(pages) < 0 or max(pages) >= limit):
                raise ValueError(f"a destination page is outside [0, {limit})")
        self._pump.kick()
        dst = peer.transfer_pages(dst_pages, dst_local_pages)
        return KVTransfer(self._sender, peer, tid, dst, stall_s, len(dst_local_pages), heads)

    async def write_pages(
        self, peer_name: str, src_pages: Sequence[int], dst_pages: Sequence[int], tid: bytes, timeout_s: float
    ) -> int:
        """Write our ``src_pages[i]`` into the peer's ``dst_pages[i]`` as one transfer; returns bytes.

        Raises:
            ValueError: lists of different length, a repeated destination page, or a page out of range.
            KVTransferError: unknown or dead peer, or a failed WRITE. KVTransferTimeout: too slow.
        """
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
        transfer = self.start_transfer(peer_name, tid, dst_pages, timeout_s)
        try:
            transfer.send(src_pages, 0)
            transfer.finish()
            return await transfer.wait(timeout_s)
        finally:
            transfer.cancel()  # no-op once complete; aborts it on error and cancellation alike

    # ---- receiver side ------------------------------------------------------------------------
    def expect(
        self,
        senders: str | Mapping[str, int],
        tid: bytes,
        dst_pages: Sequence[int],
        dst_local_pages: Sequence[int] = (),
    ) -> KVReceive:
        """Expect transfer ``tid`` into our ``dst_pages`` and ``dst_local_pages`` (of the local layers'
        pool; ``start_transfer``'s), as the transfer names them (call before asking for it), from
        ``senders``: one agent's name (it writes whole pages), or each sending agent with how many of
        our pool's heads it writes (``head_map``): every page must land from each of them.

        Raises:
            KVTransferError: ``tid`` is already expected.
        """
        if isinstance(senders, str):
            senders = {senders: self.layout.num_kv_heads}
        pages = self._info.transfer_pages(dst_pages, dst_local_pages)
        receive = self._receiver.expect(senders, self.layout.num_kv_heads, tid, pages)
        self._pump.kick()
        return receive

    def close(self) -> None:
        """Stop the threads, fail pending receives, disconnect peers and deregister the memory."""
        self._sender.close()
        self._pump.close()
        self._receiver.close()
        for name in list(self._peers):
            self.remove_peer(name)
        try:
            self._agent.deregister_memory(self._registration)
        except NIXL_ERRORS as e:
            logger.warning("deregistering KV memory of %r: %s", self.name, e)

    # ---- internals ------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return self._receiver.busy() or self._sender.busy()

    def _on_notification(self, sender: str, msg: bytes) -> None:
        kind, body = messages.parse(msg)
        if kind == messages.LANDED:
            self._receiver.on_landed(sender, body)
        else:
            self._receiver.on_abort(sender, body)

    def _call(self, peer_name: str, fn: Callable[..., T], *args: Any) -> T:
        """Call into NIXL for a transfer with ``peer_name``; NIXL errors become ``KVTransferError``."""
        try:
            return fn(*args)
        except PeerDisconnected as e:
            self.remove_peer(peer_name)
            raise KVTransferError(f"KV peer {peer_name!r} disconnected: {e}") from e
        except NIXL_ERRORS as e:
            raise KVTransferError(f"KV transfer to {peer_name!r} failed: {e}") from e


def _check_pool(kv_data: torch.Tensor, layout: KVLayout, num_layers: int) -> None:
    if layout.layout != POOL_LAYOUT:
        raise ValueError(f"unsupported KV pool layout {layout.layout!r}; expected {POOL_LAYOUT!r}")
    expected = (num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
    shape = tuple(kv_data.shape)
    if len(shape) != 6 or shape[1:] != expected:
        raise ValueError(f"kv_data shape {shape} does not match [pages, L, 2, slot, head, dim] = {expected}")
    if str(kv_data.dtype).removeprefix("torch.") != layout.dtype:
        raise ValueError(f"kv_data dtype {kv_data.dtype} does not match layout dtype {layout.dtype!r}")
    if not kv_data.is_contiguous():
        raise ValueError("kv_data must be contiguous")
