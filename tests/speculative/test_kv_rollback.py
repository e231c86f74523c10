"""Rolling back rejected drafts' KV on the scheduler's real ledger: pages wholly beyond the kept tokens
go back in the same step, pools stay conserved, and the radix cache only ever gets verified tokens."""

from __future__ import annotations

import pytest

from pdserve.mem_cache.memory_pool import PagedTokenToKVPoolAllocator, ReqToTokenPool
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.kv_ledger import KVLedger
from pdserve.scheduler.req import Req
from pdserve.speculative.kv_rollback import rollback

PAGE = 4
POOL = 32


def running(kv: KVLedger, prompt: list[int], first_token: int) -> Req:
    """A request whose prompt was prefilled (KV for it) and whose first token was sampled."""
    req = Req("r", list(prompt), SamplingParams(max_new_tokens=64))
    kv.match(req)
    assert kv.admit(req, len(prompt) + 1)
    req.num_computed = len(prompt)
    req.output_ids.append(first_token)
    return req


def verify_step(kv: KVLedger, req: Req, drafts: list[int], kept: list[int]) -> None:
    """What a scheduler does around a verify step of ``drafts``: pages for the last token and the
    drafts, their KV computed, then ``kept`` (accepted drafts and one more) appended and the
    rejected positions rolled back."""
    assert kv.grow(req, req.seq_len + len(drafts))
    req.num_computed += 1 + len(drafts)
    num_valid = req.seq_len + len(kept) - 1  # the last token and the accepted drafts have valid KV
    req.output_ids += kept
    rollback(kv, req, num_valid)


def cached_tokens(kv: KVLedger) -> list[tuple[int, ...]]:
    """Every token sequence the radix tree holds, root to each node."""
    out, stack = [], [(kv.tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            key = prefix + tuple(child.key)
            out.append(key)
            stack.append((child, key))
    return out


def test_rejected_pages_go_back_in_the_same_step():
    kv = KVLedger(ReqToTokenPool(4, 64), PagedTokenToKVPoolAllocator(POOL, PAGE), PAGE)
    req = running(kv, list(range(100, 106)), 7)  # 6 prompt tokens + 1: 2 pages
    assert len(req.pages) == 2
    verify_step(kv, req, drafts=[1, 2, 3, 4, 5, 6, 7], kept=[1, 9])  # 14 positions: 4 pages, then 9 valid
    assert req.num_computed == 8 and len(req.fill_ids) == 9  # the new token 9 has no KV yet
    assert len(req.pages) == 2 and kv.in_use[req] == 2
    kv.check_conservation(POOL)
    verify_step(kv, req, drafts=[4, 4, 4], kept=[4, 4, 4, 5])  # every draft stands: nothing to give back
    assert req.num_computed == 12 and len(req.pages) == 3
    kv.check_conservation(POOL)
    kv.release(req, cache=False)
    assert kv.free_pages() == POOL


def test_the_radix_cache_gets_verified_tokens_only():
    """A rejected draft's KV sits in the slot where the kept token after it will go: caching by the
    computed length before the rollback would key that slot with the kept token."""
    kv = KVLedger(ReqToTokenPool(4, 64), PagedTokenToKVPoolAllocator(POOL, PAGE), PAGE)
    prompt = list(range(100, 106))
    req = running(kv, prompt, 7)
    verify_step(kv, req, drafts=[1, 2, 3], kept=[1, 2, 50])  # 50 replaces draft 3 at position 9
    kv.cache_unfinished(req)
    assert req.num_computed == 9
    assert cached_tokens(kv) == [tuple(prompt + [7, 1])]  # 2 full pages of verified KV; not position 9
    kv.release(req, cache=True)
    assert all(len(key) <= 9 and list(key) == (prompt + [7, 1, 2])[: len(key)] for key in cached_tokens(kv))
    kv.check_conservation(POOL)


def test_a_rollback_beyond_the_computed_tokens_or_into_the_cached_prefix_is_refused():
    kv = KVLedger(ReqToTokenPool(4, 64), PagedTokenToKVPoolAllocator(POOL, PAGE), PAGE)
    first = running(kv, list(range(100, 110)), 7)
    first.num_computed = 11
    kv.release(first, cache=True)  # 2 full pages of it in the radix cache
    req = running(kv, list(range(100, 110)), 7)
    assert req.num_prefix_pages == 2
    with pytest.raises(ValueError, match="cannot keep 12 tokens of KV: 10 computed"):
        rollback(kv, req, 12)
    with pytest.raises(ValueError, match="8 in the radix-cache prefix"):
        rollback(kv, req, 7)
    assert rollback(kv, req, 9) == [] and req.num_computed == 9
