"""Model-based test of RadixCache (hypothesis stateful) against a dict of cached page-aligned prefixes.

Random admit / cache / abort / match / evict / reset sequences must never evict a locked page,
never free a page twice (the real allocator raises on one), always return the longest cached
prefix, evict least recently used leaves first, and keep free + cached + held == pool size. A
consumer of the cache's KV events alone (and one of its snapshot) knows exactly the cached blocks.
"""

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdserve.mem_cache.block_hash import block_hashes
from pdserve.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdserve.mem_cache.memory_pool import PagedTokenToKVPoolAllocator
from pdserve.mem_cache.radix_cache import RadixCache, TreeNode

POOL_PAGES = 24
MAX_TOKENS = 13
tails = st.lists(st.integers(0, 1), max_size=MAX_TOKENS)


@dataclass
class Held:
    """A running request: its tokens, the cached prefix pages it locks, and the pages it owns."""

    tokens: list[int]
    prefix: list[int]
    own: list[int]
    last_node: TreeNode


class RadixCacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.pool = PagedTokenToKVPoolAllocator(POOL_PAGES, page_size)
        self.cache = RadixCache(self.pool, page_size)
        self.cached: dict[tuple[int, ...], int] = {}  # page-aligned prefix -> page of its last page
        self.last_access: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.requests: list[Held] = []
        self.seen: list[list[int]] = [[]]  # admitted sequences, so later ones share their prefixes
        self.index: set[int] = set()  # the block hashes a KV-event consumer holds
        self.cache.set_event_sink(lambda event: self.apply(self.index, event))

    def apply(self, index: set[int], event: KVEvent) -> None:
        """A consumer's index: stored blocks chain from a block it holds; removed ones are held."""
        if isinstance(event, BlockStored):
            assert event.parent_block_hash is None or event.parent_block_hash in index
            assert event.block_size == self.ps and len(event.token_ids) == len(event.block_hashes) * self.ps
            assert event.block_hashes == block_hashes(event.token_ids, self.ps, event.parent_block_hash)
            index.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= index
            index.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            index.clear()

    # -- the model --------------------------------------------------------------------------
    def prefixes(self, tokens: list[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[:end]) for end in range(self.ps, len(tokens) + 1, self.ps)]

    def touch(self, keys: list[tuple[int, ...]]) -> None:
        self.clock += 1
        self.last_access.update(dict.fromkeys(keys, self.clock))

    def longest_prefix(self, tokens: list[int]) -> list[tuple[int, ...]]:
        keys = []
        for key in self.prefixes(tokens):
            if key not in self.cached:
                break
            keys.append(key)
        return keys

    def match(self, tokens: list[int]) -> tuple[list[int], TreeNode]:
        pages, node, num_tokens, _ = self.cache.match_prefix(tokens)
        keys = self.longest_prefix(tokens)
        assert pages == [self.cached[key] for key in keys]
        assert num_tokens == len(pages) * self.ps
        self.touch(keys)
        return pages, node

    def locked_pages(self) -> set[int]:
        return {page for req in self.requests for page in req.prefix}

    def evict(self, num_pages: int) -> None:
        available_before = self.pool.available_size()
        evictable_before = self.cache.evictable_size()
        freed = self.cache.evict(num_pages)
        newly_free = set(self.cached.values()) - set(self.tree_contents().values())
        assert freed == len(newly_free) == self.pool.available_size() - available_before
        assert freed >= num_pages or self.cache.evictable_size() == 0
        assert self.cache.evictable_size() == evictable_before - freed
        assert not newly_free & self.locked_pages()
        gone = [key for key, page in self.cached.items() if page in newly_free]
        for key in gone:
            del self.cached[key]
        # LRU: nothing evicted was used more recently than an unlocked leaf that stayed.
        locked = self.locked_pages()
        leaves = [
            key
            for key, page in self.cached.items()
            if page not in locked and not any(k[: len(key)] == key and k != key for k in self.cached)
        ]
        if gone and leaves:
            assert max(self.last_access[k] for k in gone) <= min(self.last_access[k] for k in leaves)

    def release(self, req: Held) -> None:
        self.cache.dec_lock_ref(req.last_node)

    def draw_tokens(self, data) -> list[int]:
        """A prefix of an earlier sequence plus a random tail (shared prefixes are the point)."""
        base = data.draw(st.sampled_from(self.seen))
        return (base[: data.draw(st.integers(0, len(base)))] + data.draw(tails))[:MAX_TOKENS]

    def pick(self, data) -> Held:
        return self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))

    # -- rules ------------------------------------------------------------------------------
    @rule(data=st.data())
    def match_only(self, data) -> None:
        self.match(self.draw_tokens(data))

    @rule(data=st.data())
    def admit(self, data) -> None:
        tokens = self.draw_tokens(data)
        self.seen.append(tokens)
        prefix, node = self.match(tokens)
        self.cache.inc_lock_ref(node)
        self.requests.append(req := Held(tokens, prefix, [], node))
        need = len(tokens) // self.ps - len(prefix)
        if need > self.pool.available_size():
            self.evict(need - self.pool.available_size())
        own = self.pool.alloc(need)
        if own is None:  # no room even after eviction: turned away
            self.release(self.requests.pop())
            return
        req.own = own

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), keep_running=st.booleans())
    def cache_request(self, data, keep_running: bool) -> None:
        """Finished request (or a chunked-prefill step when ``keep_running``) inserts its pages."""
        req = self.pick(data)
        pages = req.prefix + req.own
        keys = self.prefixes(req.tokens)
        # A page is a duplicate where the model already caches another page for that prefix.
        expected = [
            page for key, page in zip(keys, pages, strict=True) if self.cached.setdefault(key, page) != page
        ]
        assert self.cache.insert(req.tokens, pages) == expected
        self.touch(keys)
        self.pool.free(expected)
        if keep_running:
            prefix, node = self.match(req.tokens)
            assert len(prefix) == len(pages)
            self.cache.inc_lock_ref(node)
            self.requests.append(Held(req.tokens, prefix, [], node))
        self.release(req)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self.abort_one(self.pick(data))

    def abort_one(self, req: Held) -> None:
        self.pool.free(req.own)
        self.release(req)

    @rule(num_pages=st.integers(0, POOL_PAGES))
    def evict_pages(self, num_pages: int) -> None:
        self.evict(num_pages)

    @rule()
    def reset(self) -> None:
        """Flush: every request ends, then the whole cache goes back to the pool."""
        while self.requests:
            self.abort_one(self.requests.pop())
        self.cache.reset()
        self.cached.clear()
        assert self.pool.available_size() == POOL_PAGES

    # -- invariants -------------------------------------------------------------------------
    def tree_contents(self) -> dict[tuple[int, ...], int]:
        """Walk the tree, checking its structure; returns page-aligned prefix -> page."""
        contents: dict[tuple[int, ...], int] = {}
        stack = [(self.cache.root, ())]
        while stack:
            node, path = stack.pop()
            for first_page, child in node.children.items():
                assert child.parent is node and child.key[: self.ps] == first_page
                assert child.num_pages >= 1 and len(child.key) == child.num_pages * self.ps
                locks = sum(
                    1 for r in self.requests if tuple(r.tokens[: len(r.prefix) * self.ps]) == path + child.key
                ) + sum(c.lock_ref for c in child.children.values())
                assert child.lock_ref == locks
                child_path = path + child.key
                for i, page in enumerate(child.value):
                    contents[child_path[: len(path) + (i + 1) * self.ps]] = page
                stack.append((child, child_path))
        return contents

    @invariant()
    def tree_matches_model(self) -> None:
        assert self.tree_contents() == self.cached
        assert all(key[: -self.ps] in self.cached for key in self.cached if len(key) > self.ps)

    @invariant()
    def events_name_the_cached_blocks(self) -> None:
        expected = {block_hashes(key, self.ps)[-1] for key in self.cached}
        assert self.index == expected
        from_snapshot: set[int] = set()
        for event in self.cache.snapshot_events():
            self.apply(from_snapshot, event)
        assert from_snapshot == expected

    @invariant()
    def pages_are_conserved(self) -> None:
        held = [page for req in self.requests for page in req.own]
        owned = [*self.cached.values(), *held]
        assert len(set(owned)) == len(owned)  # no page owned twice
        assert self.pool.available_size() + len(owned) == POOL_PAGES  # and none leaked
        locked = self.locked_pages()
        assert locked <= set(self.cached.values())
        assert self.cache.protected_size() == len(locked)
        assert self.cache.evictable_size() == len(self.cached) - len(locked)
        assert self.cache.total_size() == len(self.cached)


RadixCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestRadixCache = RadixCacheMachine.TestCase
