"""The scheduling state every rank of a tensor-parallel scheduler must hold identically, as a hash
(the TP loop compares the ranks' digests after every step)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from pdserve.scheduler.kv_ledger import KVLedger
from pdserve.scheduler.req import Req


def state_digest(queues: Iterable[Iterable[Req]], ledger: KVLedger) -> str:
    """A 128-bit hex hash of each queue's requests in order (rid, state, progress, output ids, KV pages,
    request slot) and the pool's free / cached / used page counts."""
    h = hashlib.blake2b(digest_size=16)
    for queue in queues:
        rows = [(r.rid, r.state.value, r.num_computed, r.output_ids, r.pages, r.req_pool_idx) for r in queue]
        h.update(repr(rows).encode() + b"|")
    h.update(repr((ledger.free_pages(), ledger.cached_pages(), ledger.used_pages())).encode())
    return h.hexdigest()
