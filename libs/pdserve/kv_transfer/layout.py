"""What two schedulers exchange before KV pages can be written across: layout and agent identity.

Both dataclasses match the protobuf messages ``pdserve.v1.KVLayout`` / ``pdserve.v1.KVAgentInfo``
field for field, so the servicers convert them with ``Message(**vars(obj))``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from pdserve.kv_transfer.errors import KVLayoutMismatch

POOL_LAYOUT = "page,layer,kv,slot,head,dim"
"""Axis order of the KV pool tensor ``kv_data`` (k = 0, v = 1 on the ``kv`` axis): page-major."""


@dataclass(frozen=True)
class KVLayout:
    """The facts that must be equal on both sides for a page to mean the same thing.

    Attributes:
        model: model name or path (informational, but compared).
        dtype: torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``.
        page_size: tokens per KV page.
        num_layers, num_kv_heads, head_dim: the KV tensor geometry of one page slot.
        layout: axis order of the pool tensor; this library supports ``POOL_LAYOUT`` only.
        tp_size / tp_rank: the tensor-parallel ranks of the scheduler and the rank owning this pool
            (``num_kv_heads`` are that rank's heads); which prefill rank writes which heads into which
            decode rank is ``head_map``'s (the sizes may differ).
        num_local_layers: of ``num_layers``, the sliding-window layers whose KV is in a page space
            of its own (``SWAKVPool.swa``, ``--swa-full-tokens-ratio``); 0: every layer in one pool.
        kv_head_start: the model's first KV head in this pool (its heads are ``kv_heads``).
        total_kv_heads: the model's KV heads, all ranks together (0: ``num_kv_heads``, one rank).
    """

    model: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = POOL_LAYOUT
    tp_size: int = 1
    tp_rank: int = 0
    num_local_layers: int = 0
    kv_head_start: int = 0
    total_kv_heads: int = 0

    @property
    def kv_heads(self) -> range:
        """The model's KV heads this pool holds, in the order of its ``head`` axis."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)

    @property
    def model_kv_heads(self) -> int:
        """The model's KV heads, all ranks together."""
        return self.total_kv_heads or self.num_kv_heads

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of the (full) pool, every layer's K and V but the local layers':
        ``(num_layers - num_local_layers) * 2 * page_size * num_kv_heads * head_dim * itemsize``."""
        return (self.num_layers - self.num_local_layers) * self._layer_page_bytes()

    @property
    def local_page_bytes(self) -> int:
        """Bytes of one page of the local layers' pool (0 without one)."""
        return self.num_local_layers * self._layer_page_bytes()

    def _layer_page_bytes(self) -> int:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown KV dtype {self.dtype!r}")
        return 2 * self.page_size * self.num_kv_heads * self.head_dim * dtype.itemsize


RANK_FIELDS = frozenset({"tp_size", "tp_rank", "num_kv_heads", "kv_head_start", "total_kv_heads"})
"""The fields of one rank's share of the heads: ``head_map`` matches them, not ``check_compatible``."""


def check_compatible(local: KVLayout, remote: KVLayout, names: tuple[str, str] = ("local", "remote")) -> None:
    """Raise ``KVLayoutMismatch`` naming every differing field of the model's KV geometry, e.g.
    ``"page_size: local 16, remote 32"`` (``names`` label the sides); the model's KV heads count, not
    which of them each rank holds (``head_map`` pairs those)."""
    a, b = names
    diffs = [
        f"{f.name}: {a} {getattr(local, f.name)!r}, {b} {getattr(remote, f.name)!r}"
        for f in fields(KVLayout)
        if f.name not in RANK_FIELDS and getattr(local, f.name) != getattr(remote, f.name)
    ]
    if local.model_kv_heads != remote.model_kv_heads:
        diffs.append(f"total_kv_heads: {a} {local.model_kv_heads}, {b} {remote.model_kv_heads}")
    if local.num_local_layers != remote.num_local_layers:
        diffs.append("give both workers the same --swa-full-tokens-ratio (a local layers' pool or none)")
    if diffs:
        raise KVLayoutMismatch("KV layouts differ: " + "; ".join(diffs))


@dataclass(frozen=True)
class KVAgentInfo:
    """One scheduler's NIXL agent and the KV pool it exposes (sent once per peer, cached by name).

    Attributes:
        agent_name: unique NIXL agent name of the scheduler process.
        agent_metadata: ``nixl_agent.get_agent_metadata()`` bytes (connection info and registrations).
        layout: the pool's ``KVLayout``.
        base_addr: address of ``kv_data`` (host virtual address, or CUDA device address).
        num_bytes: size of the registered pool in bytes.
        device_id: CUDA device index of the pool, or -1 for host memory (NIXL ``DRAM``).
        num_pages: pages of the pool.
        incarnation: random id of this agent instance; a restarted scheduler has a new one.
        local_base_addr, local_num_bytes, local_num_pages: the local layers' pool (``num_local_layers``
            of the layout; zeros without one).

    A transfer names pages in one index space: ``p < num_pages`` is page ``p`` of the pool, and
    ``num_pages + q`` is page ``q`` of the local layers' pool (``transfer_pages``).
    """

    agent_name: str
    agent_metadata: bytes
    layout: KVLayout
    base_addr: int
    num_bytes: int
    device_id: int
    num_pages: int
    incarnation: str
    local_base_addr: int = 0
    local_num_bytes: int = 0
    local_num_pages: int = 0

    @property
    def mem_type(self) -> str:
        """NIXL memory segment of the pool: ``"DRAM"`` or ``"VRAM"``."""
        return "DRAM" if self.device_id < 0 else "VRAM"

    @property
    def num_transfer_pages(self) -> int:
        """Pages a transfer may name: the pool's, then the local layers' pool's."""
        return self.num_pages + self.local_num_pages

    def transfer_pages(self, pages: Sequence[int], local_pages: Sequence[int] = ()) -> list[int]:
        """The transfer's index space for the KV of ``pages`` (of the pool; left out where its pages
        hold no KV: a model whose every layer is local) and ``local_pages`` (of the local pool)."""
        full = list(pages) if self.layout.page_bytes else []
        return full + [self.num_pages + int(q) for q in local_pages]

    def page_addrs(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Transfer-space ``pages`` (int64) -> (uint64 address of each page, uint64 bytes a page)."""
        local = pages >= self.num_pages
        base = np.where(local, self.local_base_addr, self.base_addr).astype(np.uint64)
        index = np.where(local, pages - self.num_pages, pages).astype(np.uint64)
        nbytes = np.where(local, self.layout.local_page_bytes, self.layout.page_bytes).astype(np.uint64)
        return base + index * nbytes, nbytes
