"""The second KV tier: a larger, slower store of KV pages under the radix cache.

After SGLang's HiCache (host memory under the device pool) and vLLM's offloading connector: when
the radix cache evicts a node's pages, their KV is copied here instead of being lost, and a later
prefix hit copies it back into pool pages instead of recomputing it (``RadixCache`` owns which
node lives where). On CPU the store is a file-backed shared mmap (``torch.from_file``) in the
temporary directory (``TMPDIR``; on a tmpfs such as ``/dev/shm`` it is memory, on a disk it is the
page cache and the disk): the file is unlinked at once, so nothing is left behind on exit.

A tier page holds what a pool page holds: every layer's K and V of ``page_size`` tokens, in the
pool's dtype and layout (``KVPool.kv_data[page]``), so a page moves as one contiguous copy.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence

import torch

from pdserve.mem_cache.memory_pool import KVPool, PagedTokenToKVPoolAllocator

MEDIUM_TIER = "cpu_tier"  # the medium of tier-resident blocks in KV events


class KVTier:
    """``num_pages`` tier pages shaped as ``pool``'s pages, and their free-page ledger.

    Attributes:
        kv_data: ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]`` (the pool's
            dtype), over the mmap.
        allocator: which tier pages are free (the pool's allocator class; ids ``[0, num_pages)``).

    Raises:
        ValueError: ``num_pages < 1``, or a pool that is not on the CPU.
    """

    def __init__(self, pool: KVPool, num_pages: int, directory: str | None = None) -> None:
        if num_pages < 1:
            raise ValueError(f"a KV tier needs at least one page, got {num_pages}")
        if pool.kv_data.device.type != "cpu":
            raise ValueError(
                f"--kv-tier-memory: the KV tier runs with a CPU pool only so far, not {pool.kv_data.device}"
            )
        self.pool = pool
        self.num_pages = num_pages
        self.page_nbytes = pool.page_nbytes
        self.allocator = PagedTokenToKVPoolAllocator(num_pages, pool.page_size)
        shape = (num_pages, *pool.kv_data.shape[1:])
        fd, path = tempfile.mkstemp(prefix="pdserve-kv-tier-", dir=directory)
        try:
            os.ftruncate(fd, num_pages * self.page_nbytes)  # sparse: disk or memory is taken as pages fill
            numel = math.prod(shape)
            self.kv_data = torch.from_file(path, shared=True, size=numel, dtype=pool.dtype).view(shape)
        finally:
            os.close(fd)
            os.unlink(path)  # the mapping keeps the file's pages until the tier is gone

    def used_pages(self) -> int:
        return self.num_pages - self.allocator.available_size()

    def save(self, pool_pages: Sequence[int], tier_pages: Sequence[int]) -> None:
        """Copy pool pages ``pool_pages[i]`` into tier pages ``tier_pages[i]`` (equal lengths)."""
        src = torch.as_tensor(pool_pages, dtype=torch.int64)
        self.kv_data[torch.as_tensor(tier_pages, dtype=torch.int64)] = self.pool.kv_data[src]

    def load(self, tier_pages: Sequence[int], pool_pages: Sequence[int]) -> None:
        """Copy tier pages ``tier_pages[i]`` back into pool pages ``pool_pages[i]`` (equal lengths)."""
        src = torch.as_tensor(tier_pages, dtype=torch.int64)
        self.pool.kv_data[torch.as_tensor(pool_pages, dtype=torch.int64)] = self.kv_data[src]


def make_tier(runner, tier_memory: int) -> KVTier | None:
    """The tier of ``--kv-tier-memory`` bytes for ``runner``'s pool (None with 0: no tier).

    Raises:
        ValueError: the budget holds no page, or the runner's pool cannot have a tier yet (an SWA
            pool, whose local pages a tier would have to keep too; a pool off the CPU).
    """
    if not tier_memory:
        return None
    if runner.swa_pages is not None:
        raise ValueError("--kv-tier-memory cannot be combined with --swa-full-tokens-ratio yet")
    pool: KVPool = runner.kv_pool
    num_pages = tier_memory // pool.page_nbytes
    if num_pages < 1:
        raise ValueError(
            f"--kv-tier-memory {tier_memory} bytes holds no KV page ({pool.page_nbytes} bytes each)"
        )
    return KVTier(pool, num_pages)
