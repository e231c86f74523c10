"""Registered staging memory of one agent: send slots, and receive lanes granted to peers.

A slot holds up to ``pages_per_slot`` pages of every layer (``PageCopier``'s packing). The sender
gathers pages into one of its ``send_slots`` and WRITEs the slot, as one descriptor, into a slot of
the lane the receiver granted it; the receiver scatters that slot into the destination pages and
hands the slot back with an ACK. A lane is ``lane_slots`` slots and belongs to one peer (the decode
side grants one per prefill worker, by address), so no two senders ever write the same slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdserve.kv_transfer.errors import KVTransferTimeout


@dataclass(frozen=True)
class StagingConfig:
    """Sizes of an agent's staging memory (virtual until used: a decode agent never touches its send
    slots, a prefill agent never its lanes).

    Attributes:
        slot_bytes: bytes per slot; raised to one page of every layer when smaller.
        send_slots: slots a sender gathers into ahead of the wire (at least 2 to overlap the two).
        lanes: receive lanes, i.e. peers that can send through staging at once (others write pages).
        lane_slots: slots per lane: how far a sender may run ahead of the receiver's scatter.
        direct_min_bytes: pages whose runs (consecutive on both sides) make NIXL descriptors of at
            least this many bytes on average are written straight into the destination pages, one
            descriptor per run and layer; smaller ones go through staging, where a receiver granted a
            lane. Each descriptor costs about what 20 KB of the wire does, staging about twice the
            wire's work: on the loaded 2-core box they broke even near 12 KB descriptors (package docs).
    """

    slot_bytes: int = 4 << 20
    send_slots: int = 3
    lanes: int = 4
    lane_slots: int = 8
    direct_min_bytes: int = 16 << 10


class Lane(NamedTuple):
    """Receive slots ``[first_slot, first_slot + slots)`` of a staging area, as a peer sees them."""

    index: int
    first_slot: int
    slots: int
    addr: int
    slot_bytes: int


class StagingArea:
    """One registered tensor (the pool's dtype and device) of ``send_slots + lanes * lane_slots`` slots.

    Args:
        like: the pool tensor (dtype and device of the staging memory).
        span_elems: elements of one page of every plane.
        config: the sizes.
    """

    def __init__(self, like: torch.Tensor, span_elems: int, config: StagingConfig):
        itemsize = like.element_size()
        self.pages_per_slot = max(1, config.slot_bytes // (span_elems * itemsize))
        self.slot_elems = self.pages_per_slot * span_elems
        self.slot_bytes = self.slot_elems * itemsize
        self.send_slots = config.send_slots
        self.direct_min_bytes = config.direct_min_bytes
        self.lane_slots = config.lane_slots
        total = config.send_slots + config.lanes * config.lane_slots
        self.buffer = torch.empty(total * self.slot_elems, dtype=like.dtype, device=like.device)
        self._free_lanes = list(range(config.lanes - 1, -1, -1))
        self._lanes: dict[str, Lane] = {}
        self._lock = threading.Lock()

    def slot(self, index: int) -> torch.Tensor:
        """Flat view of slot ``index`` (send slots first, then the lanes' slots)."""
        return self.buffer[index * self.slot_elems : (index + 1) * self.slot_elems]

    def addr(self, index: int) -> int:
        return self.buffer.data_ptr() + index * self.slot_bytes

    def lane_for(self, key: str) -> Lane | None:
        """The lane granted to ``key`` (a peer's address), granting a free one the first time;
        None when every lane is taken (that peer then writes pages directly)."""
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None and self._free_lanes:
                index = self._free_lanes.pop()
                first = self.send_slots + index * self.lane_slots
                lane = Lane(index, first, self.lane_slots, self.addr(first), self.slot_bytes)
                self._lanes[key] = lane
            return lane


class SlotRing:
    """Free slot numbers ``0..n-1``, taken and given back from any thread."""

    def __init__(self, n: int):
        self._free = list(range(n - 1, -1, -1))
        self._n = n
        self._cond = threading.Condition()

    def acquire(self, deadline: float, poll: Callable[[], None] | None = None, what: str = "slot") -> int:
        """Take a free slot, waiting until ``deadline`` (``time.monotonic``); while waiting, ``poll``
        (e.g. fetching the ACKs that free slots) runs every 0.2 ms, else the wait sleeps on the ring.

        Raises:
            KVTransferTimeout: none was given back before the deadline.
        """
        with self._cond:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTransferTimeout(f"no free {what} within the transfer's timeout")
                if poll is None:
                    self._cond.wait(left)
                    continue
                self._cond.wait(min(left, 0.0002))
                if not self._free:
                    self._cond.release()
                    try:
                        poll()
                    finally:
                        self._cond.acquire()
            return self._free.pop()

    def release(self, slot: int) -> bool:
        """Give ``slot`` back; False (and nothing changes) when it is out of range or already free."""
        with self._cond:
            if not 0 <= slot < self._n or slot in self._free:
                return False
            self._free.append(slot)
            self._cond.notify()
            return True
