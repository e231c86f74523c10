"""One worker's cached KV blocks, rebuilt from its KV events alone (``docs/kv-events.md``).

After Dynamo's KV router and llm-d's precise prefix-cache scorer: instead of guessing what a worker
holds from what was sent to it (``prefix_tree``), the gateway applies the worker's own
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events. Block hashes are chained
(``pdserve.mem_cache.block_hash``), so a block's hash names its whole prefix and the cached prefix of
a prompt is the longest leading run of its block hashes that the index holds.

The index also knows whether it can be trusted (``usable``): it must be subscribed, have applied a
snapshot or every batch since one, and not be lagging (a request with whole prompt pages the worker
did not hold routed to it longer than ``lag_s`` ago, with no batch since). The first verdict and
each change of it are logged once.

Until a worker's events can name the blocks of a prompt just routed to it (its prefill, then the
event's trip), the index counts them as pending for ``PENDING_S`` seconds (``held_blocks``), as
Dynamo's router predicts the blocks of its active requests: otherwise the requests of a new prefix
that arrive during its first prefill all score no overlap and spread by load, each worker computing
and caching a copy. A block stored, removed or cleared is no longer pending; pending blocks are this
gateway's own (replicas agree again once the events arrive).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from pdserve.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)

PENDING_S = 10.0  # seconds a routed prompt's blocks count as held before the worker's events name them
PENDING_MAX = 1 << 16  # pending blocks kept per worker (the oldest go first): bounds a flood of prompts


class KVIndexGap(Exception):
    """A batch does not follow the last one applied (the consumer must resubscribe from a snapshot)."""


class KVIndex:
    """The blocks one worker caches, as its event stream says.

    Attributes:
        blocks: block hash -> its parent's hash (None: the first block of a prefix).
        block_size: tokens per block (the worker's page size), from its first ``BlockStored``.
        seq, incarnation: the last batch applied (None / "" before the first snapshot).
        connected: its subscription is open.
        last_batch_at: ``time.monotonic()`` of the last batch applied.
        pending: block hash -> deadline (``time.monotonic()``) of blocks routed here that no event has
            named since, oldest deadline first.
    """

    def __init__(self, role: str, address: str) -> None:
        self.role = role
        self.address = address
        self.blocks: dict[int, int | None] = {}
        self.block_size: int | None = None
        self.seq: int | None = None
        self.incarnation = ""
        self.connected = False
        self.last_batch_at: float | None = None
        self.pending: OrderedDict[int, float] = OrderedDict()
        self._unanswered_since: float | None = None  # first routing to it after the last batch
        self._bad_block_size: int | None = None
        self._usable: bool | None = None  # the verdict last logged (None: not asked yet)

    def apply(self, incarnation: str, batch: KVEventBatch, now: float) -> None:
        """Apply one batch of the worker's stream (a snapshot replaces the index).

        Raises:
            KVIndexGap: a live batch that is not the next one of the same incarnation.
        """
        if not batch.snapshot and (
            incarnation != self.incarnation or self.seq is None or batch.seq != self.seq + 1
        ):
            raise KVIndexGap(
                f"{self.role} worker {self.address}: KV event batch {batch.seq} of {incarnation} after "
                f"{self.seq} of {self.incarnation or 'none'}"
            )
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    self.blocks.pop(block, None)
                    self.pending.pop(block, None)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()
                self.pending.clear()
        self.seq, self.incarnation = batch.seq, incarnation
        self.last_batch_at = now
        self._unanswered_since = None

    def _store(self, event: BlockStored) -> None:
        if self.block_size is None:
            self.block_size = event.block_size
        elif event.block_size != self.block_size and self._bad_block_size is None:
            self._bad_block_size = event.block_size
            logger.warning(
                "%s worker %s: KV events of block size %d after %d: its index is ignored",
                self.role, self.address, event.block_size, self.block_size,
            )  # fmt: skip
        parent = event.parent_block_hash
        for block in event.block_hashes:
            self.blocks[block] = parent
            self.pending.pop(block, None)
            parent = block

    def reset(self) -> None:
        """Forget everything (the worker went away or restarted): unusable until its next snapshot."""
        self.blocks.clear()
        self.pending.clear()
        self.block_size = None
        self._bad_block_size = None
        self.seq, self.incarnation = None, ""
        self._unanswered_since = None

    def routed(self, now: float, hashes: Sequence[int] = ()) -> None:
        """A request whose prompt has whole pages the worker does not hold was just sent to it: a
        batch is due within the lag bound, and its block ``hashes`` (chained, the worker's block size)
        that the worker does not hold are pending until ``now + PENDING_S`` (seconds, monotonic)."""
        if self._unanswered_since is None:
            self._unanswered_since = now
        for block in hashes:
            if block not in self.blocks:
                self.pending[block] = now + PENDING_S
                self.pending.move_to_end(block)
        while len(self.pending) > PENDING_MAX:
            self.pending.popitem(last=False)

    def held_blocks(self, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of ``hashes`` the worker holds (``cached_blocks``) or, after those,
        has pending at ``now`` (a chain is stored from its first block, so held ones come first)."""
        while self.pending and next(iter(self.pending.values())) <= now:
            self.pending.popitem(last=False)
        n = self.cached_blocks(hashes)
        while n < len(hashes) and hashes[n] in self.pending:
            n += 1
        return n

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` (a prompt's chained block hashes) the worker holds."""
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n

    def usable(self, now: float, lag_s: float) -> bool:
        """Whether the index may be trusted now (see the module docstring); logs each change."""
        if not self.connected or self.seq is None:
            why = "its KV event stream is down"
        elif self._bad_block_size is not None:
            why = f"it sent blocks of {self._bad_block_size} and {self.block_size} tokens"
        elif self._unanswered_since is not None and now - self._unanswered_since > lag_s:
            waited = now - self._unanswered_since
            why = f"its KV events lag: none for {waited:.1f} s since a request went there"
        else:
            why = ""
        if self._usable != (not why):
            self._usable = not why
            if why:
                logger.warning("%s worker %s: %s; routing it by load alone", self.role, self.address, why)
            else:
                logger.info(
                    "%s worker %s: KV index in step (%d blocks)", self.role, self.address, len(self.blocks)
                )
        return not why
