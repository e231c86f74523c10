"""The scheduler's KV ledger: radix matching, page allocation, growth, release and eviction.

Every page is in exactly one of three places: the allocator's free list, the radix cache
(``cached``, locked or not), or owned by one request (``in use``). ``check_conservation`` asserts
free + cached + in-use == pool size.

With an SWA pool (``pdserve.mem_cache.swa_pool``) a full page may also hold a local page (the KV
of the model's sliding-window layers): allocation takes both, every free gives both back, and
``slide_windows`` gives back the local pages a request's window has passed while it runs. A request
reads, in its local layers, its pages from its window's first on (``_swa_front``); it counts as their
user (``SWAPageMap.use``), so that the local pages of radix-cache pages it reads are never evicted
under it. A radix match counts only up to the last page boundary whose window still has all its
local pages (``SWAPageMap.whole_prefix``; SGLang's ``SWARadixCache``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from pdserve.lora.manager import LoraManager, LoraSlotsFullError
from pdserve.mem_cache.kv_tier import KVTier
from pdserve.mem_cache.memory_pool import PagedTokenToKVPoolAllocator, ReqToTokenPool
from pdserve.mem_cache.radix_cache import MatchResult, RadixCache
from pdserve.mem_cache.swa_pool import SWAPageMap
from pdserve.scheduler.req import Req


class KVLedger:
    """Owns the request slots, the page allocator and the radix cache of one scheduler.

    Args:
        req_to_token_pool: request slot × position → KV token slot.
        allocator: the paged KV allocator.
        page_size: tokens per page.
        disable_radix_cache: when true, finished requests free their pages instead of caching them.
        swa: the local pages of an SWA pool, or None (every layer in the full pages).
        lora: the runner's ``LoraManager`` (None: no adapters). A request of an adapter
            (``sampling_params.lora_name``) pins its adapter's slot from admission to release, and its
            KV is matched and cached in the adapter's radix namespace only.
        tier: the KV tier under the radix cache (``--kv-tier-memory``), or None. A match that runs
            on into it loads that KV back into pool pages (allocated as any, and only when the pool
            can give them all) before the request is admitted, synchronously, on the loop thread.
        metrics: the scheduler's ``SchedulerMetrics`` (tier gauges, hits and load-back times), or None.
    """

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: PagedTokenToKVPoolAllocator,
        page_size: int,
        disable_radix_cache: bool = False,
        swa: SWAPageMap | None = None,
        lora: LoraManager | None = None,
        tier: KVTier | None = None,
        metrics=None,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.swa = swa
        # the tree's evictions free a page's local page too
        self.tree = RadixCache(swa or allocator, page_size, disable_radix_cache, tier)
        self.lora = lora
        self.metrics = metrics
        if tier is not None and metrics is not None:
            metrics.watch_tier(tier)
        self._swa_front: dict[Req, int] = {}  # request -> its first page its local layers still read
        self.in_use: dict[Req, int] = {}  # request -> pages owned (not counting radix prefix pages)
        self._offsets: torch.Tensor | None = None  # 0 .. page_size - 1, on the pool's device

    # ---- sizes --------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def free_pages(self) -> int:
        return self.allocator.available_size()

    def cached_pages(self) -> int:
        return self.tree.total_size()

    def used_pages(self) -> int:
        return sum(self.in_use.values())

    def available_pages(self) -> int:
        """Pages obtainable now: free plus evictable (and, with an SWA pool, as many local ones)."""
        full = self.free_pages() + self.tree.evictable_size()
        if self.swa is None:
            return full
        return min(full, self.swa.available_size() + self.swa.evictable_size())

    def swa_used_pages(self) -> int:
        """Local pages of an SWA pool that running requests read (0 without one)."""
        return 0 if self.swa is None else self.swa.used_pages()

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def check_conservation(self, usable_pages: int) -> None:
        """Raise AssertionError unless free + cached + in-use == ``usable_pages``."""
        total = self.free_pages() + self.cached_pages() + self.used_pages()
        if total != usable_pages:
            raise AssertionError(
                f"KV pages not conserved: free {self.free_pages()} + cached {self.cached_pages()}"
                f" + in-use {self.used_pages()} = {total} != {usable_pages}"
            )
        if self.swa is not None:
            self.swa.check()

    # ---- allocation ---------------------------------------------------------------
    def _alloc(self, n: int, unmapped: int = 0) -> list[int] | None:
        """``n`` full pages; with an SWA pool all but the first ``unmapped`` get local pages."""
        if n == 0:
            return []
        if self.allocator.available_size() < n:
            self.tree.evict(n - self.allocator.available_size())
        local = max(0, n - unmapped)
        if self.swa is not None and self.swa.available_size() < local:
            self.swa.evict(local - self.swa.available_size())
        pages = self.allocator.alloc(n)
        if pages is not None and self.swa is not None and not self.swa.map(pages[n - local :]):
            self.allocator.free(pages)
            return None
        return pages

    def _free(self, pages: Iterable[int]) -> None:
        """Give back full pages, and their local pages where they hold some."""
        (self.swa or self.allocator).free(pages)

    def _usable(self, pages: list[int]) -> list[int]:
        """The lead of a radix match's pages a request can extend from: all of them, or with an SWA
        pool up to the last boundary whose window has all its local pages."""
        return pages if self.swa is None else pages[: self.swa.whole_prefix(pages)]

    def _window_front(self, num_tokens: int) -> int:
        """The first page a query at position ``num_tokens`` reads in its local layers."""
        return max(0, (num_tokens + 1 - self.swa.window) // self.page_size)

    def arriving_local_pages(self, req: Req) -> list[int]:
        """The local pages (of the SWA pool) where a prefill worker writes the local layers' KV of an
        ``admit(..., arrives_whole=True)`` request: those of its own pages its window reads, in page
        order ([] without an SWA pool)."""
        if self.swa is None:
            return []
        return self.swa.local_pages(req.pages[max(self._swa_front[req], req.num_prefix_pages) :])

    def cached_prefix_len(self, req: Req) -> int:
        """Tokens of ``req.fill_ids`` (but its last) the radix cache holds now (nothing is locked)."""
        match = self.tree.match_prefix(req.fill_ids[:-1], req.sampling_params.lora_name)
        return len(self._usable(match.page_indices)) * self.page_size

    def match(self, req: Req, use_cache: bool = True, load_back: bool = True) -> int:
        """Radix-match ``req.fill_ids`` (leaving at least one token to extend) and lock the match;
        with ``use_cache`` False nothing is matched (a request whose whole prompt must be computed).
        With ``load_back``, a match that goes on into the KV tier brings that part into the pool.

        Returns the number of prefix tokens found (a multiple of page_size).
        """
        key = req.fill_ids[:-1] if use_cache else []
        result = self.tree.match_prefix(key, req.sampling_params.lora_name)
        self.tree.inc_lock_ref(result.last_node)
        if load_back and result.tier_nodes:
            result = self._load_back(result)
        req.last_node = result.last_node
        req.pages = list(self._usable(result.page_indices))
        req.num_prefix_pages = len(req.pages)
        req.num_computed = len(req.pages) * self.page_size
        if self.swa is not None:
            self._swa_front[req] = front = self._window_front(req.num_computed)
            self.swa.use(req.pages[front:])
        return req.num_computed

    def _load_back(self, match: MatchResult) -> MatchResult:
        """Copy the tier-resident rest of locked ``match`` into newly allocated pool pages, when the
        pool can give them all (else ``match`` stays as it is); returns the match over them, locked
        in place of ``match``."""
        need = sum(node.num_pages for node in match.tier_nodes)
        if need > self.available_pages():
            return match
        start = time.perf_counter()
        pages = self._alloc(need)
        if pages is None:
            return match
        used = self.tree.load_back(match.tier_nodes, pages)
        self._free(pages[used:])
        if not used:
            return match
        if self.metrics is not None:
            self.metrics.observe_load_back(used * self.page_size, time.perf_counter() - start)
        last, loaded = match.last_node, 0
        for node in match.tier_nodes:  # the nodes loaded back: a prefix of them, ``used`` pages
            if loaded == used:
                break
            last, loaded = node, loaded + node.num_pages
        self.tree.inc_lock_ref(last)
        self.tree.dec_lock_ref(match.last_node)
        page_indices = match.page_indices + pages[:used]
        return MatchResult(page_indices, last, len(page_indices) * self.page_size)

    def unmatch(self, req: Req) -> None:
        """Undo ``match`` for a request that could not be admitted."""
        if self.swa is not None:
            self.swa.unuse(req.pages[self._swa_front.pop(req) :])
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = None
        req.pages = []
        req.num_prefix_pages = 0
        req.num_computed = 0

    def admit(self, req: Req, num_tokens: int, arrives_whole: bool = False) -> bool:
        """Give a matched ``req`` a request slot and pages covering ``num_tokens`` positions.

        ``arrives_whole``: the KV of all ``num_tokens`` positions is written at once (a PD decode
        worker's prompt, from a prefill worker): with an SWA pool only the pages the window of the
        query at ``num_tokens`` reads get local pages (``arriving_local_pages``); those behind it never
        do. Returns False (and changes nothing) when the pool or the slots are short.
        """
        need = self.pages_for(num_tokens) - len(req.pages)
        if need > self.available_pages() or self.req_to_token_pool.available_size() == 0:
            return False
        front = self._window_front(num_tokens) if arrives_whole and self.swa is not None else 0
        pages = self._alloc(need, max(0, front - len(req.pages)))
        if pages is None:
            return False
        if front > self._swa_front.get(req, front):  # the matched pages behind it: not read any more
            self.swa.unuse(req.pages[self._swa_front[req] : front])
            self._swa_front[req] = front
        req.req_pool_idx = self.req_to_token_pool.alloc()
        req.pages.extend(pages)
        self.in_use[req] = len(req.pages) - req.num_prefix_pages
        self._write_req_to_token([(req, 0, len(req.pages))])
        return True

    def grow(self, req: Req, num_tokens: int) -> bool:
        """Make sure ``req`` has pages for ``num_tokens`` positions; False when the pool is short."""
        return self.grow_all([req], [num_tokens])

    def grow_all(self, reqs: Sequence[Req], num_tokens: Sequence[int]) -> bool:
        """Make sure every ``reqs[i]`` has pages for ``num_tokens[i]`` positions: one allocation and
        one ``req_to_token`` write for all of them (a decode step grows a page for every
        ``page_size``-th request on average). Returns False, changing nothing, when the pool cannot
        give them all (the caller then grows them one by one, retracting)."""
        needs = [(req, self.pages_for(n) - len(req.pages)) for req, n in zip(reqs, num_tokens, strict=True)]
        needs = [(req, need) for req, need in needs if need > 0]
        total = sum(need for _, need in needs)
        if total == 0:
            return True
        if total > self.available_pages():
            return False
        pages = self._alloc(total)
        if pages is None:
            return False
        spans, taken = [], 0
        for req, need in needs:
            first = len(req.pages)
            req.pages.extend(pages[taken : taken + need])
            taken += need
            self.in_use[req] += need
            spans.append((req, first, first + need))
        self._write_req_to_token(spans)
        return True

    def _write_req_to_token(self, spans: Sequence[tuple[Req, int, int]]) -> None:
        """For each ``(req, first, last)``, write the token slots of ``req.pages[first:last]`` into
        ``req``'s ``req_to_token`` row (positions ``[first * page_size, last * page_size)``): whole
        pages, so one indexed write of page × offset for all of them."""
        pool = self.req_to_token_pool.req_to_token
        if self._offsets is None:
            self._offsets = torch.arange(self.page_size, dtype=torch.int64, device=pool.device)
        rows: list[int] = []
        positions: list[int] = []
        pages: list[int] = []
        for req, first, last in spans:
            rows += [req.req_pool_idx] * (last - first)
            positions += range(first, last)
            pages += req.pages[first:last]
        if not pages:
            return
        index = torch.tensor([rows, positions, pages], dtype=torch.int64, device=pool.device)[:, :, None]
        slots = index[2] * self.page_size + self._offsets
        pool[index[0], index[1] * self.page_size + self._offsets] = slots.to(pool.dtype)

    def cache_unfinished(self, req: Req) -> None:
        """Put the full pages of a still-running ``req``'s computed tokens into the radix cache.

        Requests admitted later then share them at once instead of after ``req`` finishes (SGLang's
        ``cache_unfinished_req``). ``req`` keeps using them: its lock moves to the new last node,
        pages the tree already held under other indices replace its duplicates (which are freed)
        in ``req.pages`` and in ``req_to_token``, and they stop counting as in use.
        """
        full = min(_known_computed(req) // self.page_size, len(req.pages))
        if self.tree.disable or full <= req.num_prefix_pages:
            return
        key = req.fill_ids[: full * self.page_size]
        own = req.pages[:full]
        namespace = req.sampling_params.lora_name
        duplicates = self.tree.insert(key, own, namespace)
        match = self.tree.match_prefix(key, namespace)
        if self.swa is not None:
            self.swa.cache(match.page_indices, own)
            front = self._swa_front[req]  # the cache's pages it reads now in place of its own
            self.swa.use([t for t, o in zip(match.page_indices[front:], own[front:], strict=True) if t != o])
        self._free(duplicates)
        self.tree.inc_lock_ref(match.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.pages[:full] = match.page_indices
        req.num_prefix_pages = full
        self.in_use[req] = len(req.pages) - full
        self._write_req_to_token([(req, 0, full)])

    def truncate(self, req: Req, num_valid: int) -> list[int]:
        """Keep ``req``'s KV for positions ``[0, num_valid)`` only: after a speculative verify step,
        the last token and the accepted drafts. Sets ``req.num_computed`` to it (the radix cache
        takes its keys from there, so it never holds an unverified token) and frees the pages it owns
        wholly beyond, in the same step; rejected slots inside the kept last page are written again
        by the next step (``req_to_token`` past ``num_valid`` stays stale: nothing reads beyond a
        length). Returns the freed pages.

        Call it when the verify step's result is processed, before anything caches ``req``'s KV, and
        only while no other scheduled batch holds ``req``.

        Raises:
            ValueError: ``num_valid`` beyond the computed tokens, or inside the radix-cache prefix.
        """
        if not req.num_prefix_pages * self.page_size <= num_valid <= req.num_computed:
            raise ValueError(
                f"rid {req.rid}: cannot keep {num_valid} tokens of KV: {req.num_computed} computed, "
                f"{req.num_prefix_pages * self.page_size} in the radix-cache prefix"
            )
        freed = req.pages[self.pages_for(num_valid) :]
        if freed:
            self._free(freed)
            del req.pages[len(req.pages) - len(freed) :]
            self.in_use[req] -= len(freed)
        req.num_computed = num_valid
        return freed

    # ---- release ------------------------------------------------------------------
    def release_when_idle(self, req: Req, cache: bool) -> None:
        """``release`` an ended ``req`` now or, while a scheduled forward still reads and writes its
        KV (``req.in_batches``), once the last such batch is processed (``release_deferred``)."""
        if req.in_batches:
            req.release_cache = cache
        else:
            self.release(req, cache)

    def release_deferred(self, req: Req) -> None:
        """The release ``release_when_idle`` deferred, once no scheduled batch holds ``req`` any more."""
        if req.in_batches == 0 and req.release_cache is not None:
            self.release(req, cache=req.release_cache)
            req.release_cache = None

    def release(self, req: Req, cache: bool) -> None:
        """Give back everything ``req`` holds, exactly once.

        With ``cache`` (a finished request whose KV is valid), the full pages of the tokens that
        have KV go into the radix cache; the partial last page and unused pages are freed.
        Otherwise (abort, failure, retraction) every owned page is freed.
        """
        if req not in self.in_use and req.last_node is None:
            return
        owned = req.pages[req.num_prefix_pages :]
        if self.swa is not None:
            self.swa.unuse(req.pages[self._swa_front.pop(req, 0) :])
        if cache:
            full = min(_known_computed(req) // self.page_size, len(req.pages))
            key = req.fill_ids[: full * self.page_size]
            namespace = req.sampling_params.lora_name
            duplicates = self.tree.insert(key, req.pages[:full], namespace)
            if self.swa is not None and not self.tree.disable:
                self.swa.cache(self.tree.match_prefix(key, namespace).page_indices, req.pages[:full])
            self._free(duplicates)
            self._free(req.pages[max(full, req.num_prefix_pages) :])
        else:
            self._free(owned)
        self.tree.dec_lock_ref(req.last_node)
        if req.req_pool_idx is not None:
            self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.pages = []
        req.num_prefix_pages = 0
        req.num_computed = 0
        self.in_use.pop(req, None)
        self.unpin_adapter(req)

    def pin_adapter(self, req: Req) -> bool:
        """Pin the slot of ``req``'s LoRA adapter (``req.lora_slot``) for its time admitted; False
        (nothing pinned) while every slot holds another adapter that running requests use."""
        name = req.sampling_params.lora_name
        if not name or req.lora_slot >= 0:
            return True
        try:
            req.lora_slot = self.lora.acquire(name)
        except LoraSlotsFullError:
            return False
        return True

    def unpin_adapter(self, req: Req) -> None:
        """Undo ``pin_adapter`` (nothing when ``req`` holds no slot)."""
        if req.lora_slot >= 0:
            self.lora.release(req.sampling_params.lora_name)
            req.lora_slot = -1

    def lora_resident(self) -> tuple[str, ...]:
        """The LoRA adapters in the slots, least recently used first (none without LoRA)."""
        return () if self.lora is None else tuple(self.lora.resident)

    # ---- sliding windows ----------------------------------------------------------
    def slide_windows(self, reqs: Iterable[Req], computed_tokens: Callable[[Req], int]) -> None:
        """With an SWA pool, ``reqs`` stop reading, in their local layers, the pages whose every
        position fell behind their window (Beltagy et al. 2020's local attention, as in Mistral and
        Gemma 3's local layers): a query at position ``p`` reads keys ``(p - window, p]``, and every
        query still to run, in a batch scheduled or later, is at a position of at least
        ``computed_tokens(req)`` (the tokens whose KV is written; a verify step's rejected drafts
        are already truncated). The local pages of the request's own pages go back at once; those
        of radix-cache pages stay cached until the local pool runs short. The full pages stay, for
        the global layers and ``req_to_token``; a local layer reads the null page behind its window."""
        if self.swa is None:
            return
        for req in reqs:
            if req not in self._swa_front:
                continue
            behind, front = self._window_front(computed_tokens(req)), self._swa_front[req]
            if behind > front:
                self.swa.unuse(req.pages[front:behind])
                self.swa.unmap(req.pages[max(front, req.num_prefix_pages) : behind])
                self._swa_front[req] = behind


def _known_computed(req: Req) -> int:
    """Tokens whose KV is in the pool (or being written by a forward that runs before any later one)
    and whose ids are known: a step scheduled ahead of its predecessor's result has computed positions
    whose token ids are still pending, and those cannot key the radix cache."""
    return min(req.num_computed, len(req.origin_input_ids) + len(req.output_ids))
