"""Memory pools: ``req_to_token`` (request slot × position → KV slot) and the paged ``token_to_kv`` pool.

Two levels of indirection, as in SGLang's ``memory_pool.py``: a request owns a row of
``ReqToTokenPool.req_to_token``; each entry is a token slot ``page * page_size + offset`` of the
``KVPool``, whose pages are handed out by ``PagedTokenToKVPoolAllocator`` (paged KV as in vLLM's
PagedAttention, Kwon et al. 2023). The allocator only counts pages; the scheduler owns the
bookkeeping of which request (or radix-cache node) holds which page.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


class ReqToTokenPool:
    """Request slots, each a row of KV token slots.

    Attributes:
        req_to_token: int64 tensor ``[size, max_context_len]``; row ``r`` position ``p`` holds the
            token slot of the request in slot ``r`` at sequence position ``p``.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        if size <= 0 or max_context_len <= 0:
            raise ValueError(
                f"ReqToTokenPool needs size > 0 and max_context_len > 0, got {size}, {max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free = list(range(size - 1, -1, -1))  # pop() hands out the lowest slot first
        self._is_free = [True] * size

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """Take a free request slot; ``None`` when all ``size`` slots are in use."""
        if not self._free:
            return None
        idx = self._free.pop()
        self._is_free[idx] = False
        return idx

    def free(self, idx: int) -> None:
        """Return slot ``idx``. Raises ValueError when it is out of range or already free."""
        if not 0 <= idx < self.size:
            raise ValueError(f"request slot {idx} out of range [0, {self.size})")
        if self._is_free[idx]:
            raise ValueError(f"request slot {idx} freed twice")
        self._is_free[idx] = True
        self._free.append(idx)


class PagedTokenToKVPoolAllocator:
    """Free-page ledger of a ``KVPool`` of ``num_pages`` pages of ``page_size`` tokens.

    A request's pages are handed out in as few runs of consecutive ids as the free space allows: the
    smallest free run that holds them all (best fit, lowest id on ties), else the longest runs first.
    Runs keep a prompt's pages together in the pool, so a KV transfer moves them as few large NIXL
    descriptors, and filling the smallest holes first keeps long runs free for long prompts (after a
    random alloc/free history of a 4,096-page pool, 63 and 250-page requests got 1-5 runs where
    lowest-id-first gave 6-54; ``make bench-kv``'s after-churn placement). All pages are usable.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"allocator needs num_pages > 0 and page_size > 0, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._is_free = np.ones(num_pages, dtype=bool)
        self._num_free = num_pages

    def available_size(self) -> int:
        """Number of free pages."""
        return self._num_free

    def alloc(self, num_pages: int) -> list[int] | None:
        """Take ``num_pages`` pages (ascending ids); ``None`` (and nothing taken) when short."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > self._num_free:
            return None
        if num_pages == 0:
            return []
        edges = np.diff(self._is_free.astype(np.int8), prepend=0, append=0)
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        lengths = ends - starts
        fits = np.flatnonzero(lengths >= num_pages)
        if len(fits):
            best = fits[np.argmin(lengths[fits])]  # argmin: the first (lowest id) of equal lengths
            pages = np.arange(starts[best], starts[best] + num_pages)
        else:
            order = np.argsort(-lengths, kind="stable")
            need = np.cumsum(lengths[order])
            taken = order[: np.searchsorted(need, num_pages) + 1]
            pages = np.concatenate([np.arange(starts[i], ends[i]) for i in taken])[:num_pages]
            pages.sort()
        self._is_free[pages] = False
        self._num_free -= num_pages
        return pages.tolist()

    def free(self, pages: Iterable[int]) -> None:
        """Return pages. Raises ValueError on an id out of range or a page already free (no page
        of the call is freed then)."""
        pages = list(pages)
        seen: set[int] = set()
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page {page} out of range [0, {self.num_pages})")
            if self._is_free[page] or page in seen:
                raise ValueError(f"page {page} freed twice")
            seen.add(page)
        self._is_free[pages] = True
        self._num_free += len(pages)


class KVPool:
    """MHA ``token_to_kv`` pool: one contiguous tensor for the K and V of every layer, page-major.

    A page holds its tokens' K and V of every layer in one contiguous byte range, so a KV transfer
    moves a run of consecutive pages, whatever the number of layers, as one NIXL descriptor (the
    layout FlashInfer's non-contiguous paged KV supports, and the one SGLang's HiCache calls
    "page first"). Each layer's K (V) is a view ``[num_pages, page_size, Hkv, D]`` whose pages lie
    ``page_stride`` elements apart; the attention kernels read it in place.

    Attributes:
        kv_data: ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]`` (index 0 = K,
            1 = V), zero-initialised so padded reads are finite.
        page_stride: elements between consecutive pages of one layer's K (or V) view.
        page_nbytes: bytes of one page of every layer, K and V (what a transfer moves per page).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
        self.kv_data = torch.zeros(shape, dtype=dtype, device=device)
        self.page_stride = self.kv_data.stride(0)
        self.page_nbytes = self.page_stride * self.kv_data.element_size()

    @property
    def nbytes(self) -> int:
        return self.kv_data.nbytes

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """KV bytes one token takes over all layers (K and V)."""
        return num_layers * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def kv_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V: views ``[num_pages, page_size, num_kv_heads, head_dim]``, each
        page contiguous, pages ``page_stride`` elements apart."""
        return self.kv_data[:, layer, 0], self.kv_data[:, layer, 1]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[T, num_kv_heads, head_dim]``, any float dtype) at token slots ``loc``
        (int64 ``[T]``: offset ``loc % page_size`` of page ``loc // page_size``)."""
        k_pages, v_pages = self.kv_pages(layer)
        page, offset = loc // self.page_size, loc % self.page_size
        k_pages[page, offset] = k.to(self.dtype)
        v_pages[page, offset] = v.to(self.dtype)


def num_pages_for_budget(
    page_size: int,
    bytes_per_token: int,
    max_total_tokens: int | None = None,
    kv_cache_memory: int | None = None,
) -> int:
    """Pages a KV pool gets from a token budget or, failing that, a byte budget.

    Raises:
        ValueError: neither budget is given, or the budget holds less than one page.
    """
    if max_total_tokens is not None:
        num_pages = max_total_tokens // page_size
    elif kv_cache_memory is not None:
        num_pages = kv_cache_memory // (bytes_per_token * page_size)
    else:
        raise ValueError("give max_total_tokens or kv_cache_memory to size the KV pool")
    if num_pages < 1:
        raise ValueError(f"KV budget holds {num_pages} pages of {page_size} tokens; it needs at least one")
    return num_pages


def slots_for_pages(pages: list[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """Token slots (int64 ``[end - start]``) of sequence positions ``[start, end)`` of a request
    whose position ``p`` lives in page ``pages[p // page_size]`` at offset ``p % page_size``.

    Raises:
        ValueError: ``end`` goes past the last page.
    """
    if end > len(pages) * page_size or start < 0 or start > end:
        raise ValueError(f"positions [{start}, {end}) do not fit {len(pages)} pages of {page_size}")
    positions = torch.arange(start, end, dtype=torch.int64)
    page_ids = torch.as_tensor(pages, dtype=torch.int64)
    return page_ids[positions // page_size] * page_size + positions % page_size
