"""Sliding-window-aware KV memory: a page space of its own for the local (sliding-window) layers.

A model that interleaves local layers with global ones (Gemma 3: 5 local to 1 global; gpt-oss:
alternating; Mistral: all local) needs, in a local layer, only the KV of the last ``window`` tokens
of a sequence. ``SWAKVPool`` keeps the global layers in a ``KVPool`` of the usual pages (the page
ids ``req_to_token`` holds) and the local layers in a second, smaller ``KVPool``; ``full_to_swa``
maps each full page to the local page that holds its tokens in the local layers, or to the null
page (the local pool's last, never handed out, zeros) once every position of it fell behind the
window. The mapping is SGLang's ``SWATokenToKVPool`` / ``full_to_swa_index_mapping`` (page-granular
here); a step's page table and KV slots are translated through it once, when the step is built
(``ForwardBatch.swa_page_rows`` / ``swa_out_cache_loc``), for every local layer.

``SWAPageMap`` is the scheduler's side: the local pages' allocator, which full page holds which,
and which running requests still read each (``KVLedger`` drives it). A request's full pages get
local pages when they are allocated and give them back when its window has passed them; pages in
the radix cache keep theirs until the local pool runs short, and a prefix hit counts only up to
the last point whose window still has all its local pages (SGLang's ``SWARadixCache``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch

from pdserve.mem_cache.memory_pool import KVPool, PagedTokenToKVPoolAllocator

logger = logging.getLogger(__name__)


class SWAKVPool:
    """The KV of global layers in ``full`` (page ids of ``req_to_token``), of local layers in ``swa``.

    Args:
        num_pages: full pages (the page ids the scheduler hands out).
        num_swa_pages: local pages (one more, the null page, is allocated).
        windows: each layer's sliding window in tokens, 0 for a global layer.
        page_size, num_kv_heads, head_dim, dtype, device: as ``KVPool``'s.

    Attributes:
        full, swa: the two ``KVPool``; ``swa`` has ``num_swa_pages + 1`` pages.
        full_to_swa: int64 ``[num_pages]`` on ``device``: the local page of each full page, or
            ``null_page`` (its local KV is gone, or it has none).
        window: the longest window of the local layers, in tokens.
    """

    def __init__(
        self,
        num_pages: int,
        num_swa_pages: int,
        windows: list[int],
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ):
        if not any(windows) or num_swa_pages < 1:
            raise ValueError(f"an SWA pool needs local layers and pages, got {windows}, {num_swa_pages}")
        self.page_size, self.dtype, self.num_layers = page_size, dtype, len(windows)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.is_local = [w > 0 for w in windows]
        self.window = max(windows)
        self._index: list[int] = []  # a layer's index within its own pool
        counts = [0, 0]
        for local in self.is_local:
            self._index.append(counts[local])
            counts[local] += 1
        shape = (page_size, num_kv_heads, head_dim, dtype, device)
        self.full = KVPool(num_pages, page_size, counts[False], *shape[1:])
        self.swa = KVPool(num_swa_pages + 1, page_size, counts[True], *shape[1:])
        self.num_swa_pages = self.null_page = num_swa_pages
        self.full_to_swa = torch.full((num_pages,), self.null_page, dtype=torch.int64, device=device)

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + self.swa.nbytes

    def _pool(self, layer: int) -> tuple[KVPool, int]:
        return (self.swa if self.is_local[layer] else self.full), self._index[layer]

    def kv_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V pages in its own pool (``KVPool.kv_pages``): local pages for a
        local layer, read through ``swa_page_rows`` / ``swa_slots``."""
        pool, index = self._pool(layer)
        return pool.kv_pages(index)

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``KVPool.set_kv`` in ``layer``'s own pool; ``loc`` are slots of that pool (a local layer's
        from ``swa_slots``)."""
        pool, index = self._pool(layer)
        pool.set_kv(index, loc, k, v)

    def swa_page_rows(
        self, req_to_token: torch.Tensor, pool_rows: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """int64 ``[B, max_pages]``: the local pages of requests ``pool_rows`` (``req_to_token`` rows)
        holding ``seq_lens`` tokens (the null page where gone; any page past a request's length).

        Read when a step is built, on the scheduler's thread: the map may change for the next step
        (a window slides, a page moves into the radix cache) while this one runs.
        """
        max_pages = -(-int(seq_lens.max()) // self.page_size)
        first_slots = req_to_token[pool_rows, : max_pages * self.page_size : self.page_size]
        return self.full_to_swa[first_slots // self.page_size]

    def swa_slots(self, loc: torch.Tensor) -> torch.Tensor:
        """Full token slots (int64 ``[T]``) -> the same tokens' slots in the local pool."""
        return self.full_to_swa[loc // self.page_size] * self.page_size + loc % self.page_size


class SWAPageMap:
    """The local pages of an ``SWAKVPool``: their allocator, which full page holds which, and who
    still needs them (the scheduler's bookkeeping; the device map ``full_to_swa`` follows).

    A full page holds its local page from its allocation (``map``) until the full page is freed
    (``free``: by its request, or by the radix cache's eviction, which calls it), or until its local
    page is released earlier: a request's own page once its window has passed (``unmap``), a radix
    cache page (``cache``) once no request needs it (``unuse``) and the local pool runs short
    (``evict``, least recently needed first; the page then stays cached for the global layers only,
    a tombstone for the local ones, as in SGLang's ``SWARadixCache``). ``users`` counts the running
    requests that still read a page in their local layers (it lies inside or ahead of their window).

    Args:
        pool: the SWA pool.
        allocator: the full pages' allocator (``free`` gives pages back to it).
    """

    def __init__(self, pool: SWAKVPool, allocator: PagedTokenToKVPoolAllocator):
        self.full_allocator = allocator
        self.allocator = PagedTokenToKVPoolAllocator(pool.num_swa_pages, pool.page_size)
        self.page_size, self.window, self.null_page = pool.page_size, pool.window, pool.null_page
        self._device_map = pool.full_to_swa
        n = len(pool.full_to_swa)
        self._swa_of = np.full(n, -1, dtype=np.int64)  # host copy of the map; -1: none
        self._users = np.zeros(n, dtype=np.int64)
        self._cached = np.zeros(n, dtype=bool)  # the radix cache owns the full page
        self._last_used = np.zeros(n, dtype=np.int64)  # when its users last dropped to 0
        self._clock = 0

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def available_size(self) -> int:
        """Free local pages."""
        return self.allocator.available_size()

    def used_pages(self) -> int:
        """Local pages some running request still reads."""
        return int(((self._swa_of >= 0) & (self._users > 0)).sum())

    def held_pages(self) -> int:
        """Local pages held by full pages (counted from the map, not the allocator)."""
        return int((self._swa_of >= 0).sum())

    def evictable_size(self) -> int:
        """Local pages of radix-cache pages no running request reads (``evict`` can take them)."""
        return int(self._evictable().sum())

    def check(self) -> None:
        """Raise AssertionError unless free + held == the local pool and every held local page is
        read by a running request or cached."""
        if self.available_size() + self.held_pages() != self.num_pages:
            raise AssertionError(
                f"local KV pages not conserved: free {self.available_size()} + held {self.held_pages()}"
                f" != {self.num_pages}"
            )
        if (self._users < 0).any():
            raise AssertionError("a page has a negative count of local-layer readers")
        if ((self._swa_of >= 0) & (self._users == 0) & ~self._cached).any():
            raise AssertionError("a local KV page is held by a full page nothing reads or caches")

    # ---- a request's pages ----------------------------------------------------------
    def map(self, pages: list[int]) -> bool:
        """Give each of the new full ``pages`` of one request a local page (the request is their
        user); False, nothing taken, when the local pool is short."""
        swa = self.allocator.alloc(len(pages))
        if swa is None:
            return False
        if pages:
            self._set(pages, swa)
            self._users[pages] = 1
        return True

    def use(self, pages: list[int]) -> None:
        """One more running request reads these (matched) pages in its local layers."""
        if pages:
            np.add.at(self._users, pages, 1)

    def unuse(self, pages: list[int]) -> None:
        """One request fewer reads these pages (its window passed them, or it ended)."""
        if not pages:
            return
        np.subtract.at(self._users, pages, 1)
        self._clock += 1
        self._last_used[pages] = self._clock

    def local_pages(self, pages: list[int]) -> list[int]:
        """The local pages of full ``pages``, in order.

        Raises:
            ValueError: one of them holds none (its window passed it, or it never had one).
        """
        local = self._swa_of[np.asarray(pages, dtype=np.int64)]
        if (local < 0).any():
            raise ValueError(f"full pages {np.asarray(pages)[local < 0].tolist()} hold no local KV page")
        return local.tolist()

    def unmap(self, pages: Iterable[int]) -> None:
        """Free the local pages of those full ``pages`` that have one."""
        held = [p for p in pages if self._swa_of[p] >= 0]
        if held:
            self.allocator.free(self._swa_of[held].tolist())
            self._set(held, [self.null_page] * len(held))

    def free(self, pages: Iterable[int]) -> None:
        """Give full ``pages`` back to their allocator, with their local pages (``PageFreer``)."""
        pages = list(pages)
        if not pages:
            return
        self.unmap(pages)
        self._users[pages] = 0
        self._cached[pages] = False
        self.full_allocator.free(pages)

    # ---- the radix cache's pages ----------------------------------------------------
    def cache(self, tree_pages: list[int], own_pages: list[int]) -> None:
        """``own_pages`` of a request went into the radix cache, which holds ``tree_pages`` for the
        same tokens (the request's own where the cache took them, else the cache's): where the
        cache's page lost its local page and the request's has one, the local page moves over
        (the request's is freed as a duplicate next), so the cache's pages are whole again."""
        if not tree_pages:
            return
        self._cached[tree_pages] = True
        for tree, own in zip(tree_pages, own_pages, strict=True):
            if tree != own and self._swa_of[tree] < 0 <= self._swa_of[own]:
                swa = int(self._swa_of[own])
                self._set([own, tree], [self.null_page, swa])

    def evict(self, num_pages: int) -> int:
        """Free the local pages of up to ``num_pages`` radix-cache pages no request reads, least
        recently read first; their full pages stay cached. Returns local pages freed."""
        candidates = np.flatnonzero(self._evictable())
        victims = candidates[np.argsort(self._last_used[candidates], kind="stable")][:num_pages]
        self.unmap(victims.tolist())
        return len(victims)

    def whole_prefix(self, pages: list[int]) -> int:
        """Of a radix match's ``pages``, how many lead a prefix whose window is whole: the largest
        ``j`` such that the tokens ``[j * page_size - window + 1, j * page_size)`` (which the query
        at position ``j * page_size`` reads) all still have local pages. 0 when none is."""
        held = self._swa_of[np.asarray(pages, dtype=np.int64)] >= 0
        for j in range(len(pages), 0, -1):
            if held[max(0, (j * self.page_size - self.window + 1) // self.page_size) : j].all():
                return j
        return 0

    def _evictable(self) -> np.ndarray:
        return (self._swa_of >= 0) & (self._users == 0) & self._cached

    def _set(self, pages: list[int], swa: list[int]) -> None:
        self._swa_of[pages] = [-1 if s == self.null_page else s for s in swa]
        index = torch.as_tensor(pages, dtype=torch.int64, device=self._device_map.device)
        self._device_map[index] = torch.as_tensor(swa, dtype=torch.int64, device=self._device_map.device)


def swa_layer_weight(windows: list[int], swa_full_tokens_ratio: float) -> float:
    """Layers' worth of KV bytes one full-pool token costs when the local pool holds
    ``swa_full_tokens_ratio`` tokens per full-pool token (SGLang's ``--swa-full-tokens-ratio``):
    sizing the full pool by a byte budget over this weight gives both pools that budget.

    Raises:
        ValueError: a ratio outside (0, 1].
    """
    if not 0 < swa_full_tokens_ratio <= 1:
        raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], got {swa_full_tokens_ratio}")
    num_local = sum(w > 0 for w in windows)
    return len(windows) - num_local + swa_full_tokens_ratio * num_local


def num_swa_pages(num_pages: int, swa_full_tokens_ratio: float, context_pages: int) -> int:
    """Local pages for ``num_pages`` full ones: the ratio's share, and at least what one request of
    the whole context (or the whole full pool) needs, since a prompt's local pages are all taken
    at admission and go back only as its window slides (so no request is refused for ever)."""
    return max(int(num_pages * swa_full_tokens_ratio), min(num_pages, context_pages), 1)


def make_swa_pool(
    allocator: PagedTokenToKVPoolAllocator,
    windows: list[int],
    swa_full_tokens_ratio: float,
    context_length: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> tuple[SWAKVPool, SWAPageMap]:
    """The SWA pool of a model whose layers have ``windows`` over ``allocator``'s full pages, its
    local pool sized by ``num_swa_pages``, and the scheduler's map of it."""
    num_pages, page_size = allocator.num_pages, allocator.page_size
    local_pages = num_swa_pages(num_pages, swa_full_tokens_ratio, -(-context_length // page_size))
    pool = SWAKVPool(num_pages, local_pages, windows, page_size, num_kv_heads, head_dim, dtype, device)
    logger.info(
        "%d of %d layers slide a window of up to %d tokens: their KV in %d local pages (%d full pages)",
        sum(pool.is_local), len(windows), pool.window, local_pages, num_pages,
    )  # fmt: skip
    return pool, SWAPageMap(pool, allocator)
