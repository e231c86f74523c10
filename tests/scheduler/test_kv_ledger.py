"""KVLedger.grow_all: one allocation and one req_to_token write for a whole decode step."""

from __future__ import annotations

import torch

from pdserve.mem_cache.memory_pool import PagedTokenToKVPoolAllocator, ReqToTokenPool
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.scheduler.kv_ledger import KVLedger
from pdserve.scheduler.req import Req

PAGE = 4


def ledger(num_pages: int) -> KVLedger:
    return KVLedger(ReqToTokenPool(8, 64), PagedTokenToKVPoolAllocator(num_pages, PAGE), PAGE)


def admitted(kv: KVLedger, rid: str, prompt_len: int) -> Req:
    req = Req(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=8))
    kv.match(req)
    assert kv.admit(req, prompt_len)
    return req


def slots_of(kv: KVLedger, req: Req, positions: int) -> list[int]:
    """The token slots ``req``'s pages give its first ``positions`` positions, page by page."""
    return [page * PAGE + offset for page in req.pages for offset in range(PAGE)][:positions]


def test_grow_all_gives_pages_only_to_those_that_need_them_and_writes_their_rows() -> None:
    kv = ledger(32)
    full, partial, also_full = admitted(kv, "a", 8), admitted(kv, "b", 6), admitted(kv, "c", 4)
    before = {req.rid: list(req.pages) for req in (full, partial, also_full)}
    free = kv.free_pages()

    assert kv.grow_all([full, partial, also_full], [9, 7, 5])

    assert full.pages[:2] == before["a"] and len(full.pages) == 3
    assert partial.pages == before["b"]  # 7 positions fit in its 2 pages
    assert also_full.pages[:1] == before["c"] and len(also_full.pages) == 2
    assert kv.free_pages() == free - 2
    assert kv.in_use[full] == 3 and kv.in_use[partial] == 2 and kv.in_use[also_full] == 2
    rows = kv.req_to_token_pool.req_to_token
    for req, positions in ((full, 12), (partial, 8), (also_full, 8)):
        assert rows[req.req_pool_idx, :positions].tolist() == slots_of(kv, req, positions)
    kv.check_conservation(32)


def test_grow_all_changes_nothing_when_the_pool_cannot_give_everyone_a_page() -> None:
    kv = ledger(5)
    a, b = admitted(kv, "a", 8), admitted(kv, "b", 8)  # 4 of 5 pages
    pages = (list(a.pages), list(b.pages))
    rows = kv.req_to_token_pool.req_to_token.clone()

    assert not kv.grow_all([a, b], [9, 9])

    assert (a.pages, b.pages) == pages
    assert kv.free_pages() == 1 and kv.in_use[a] == 2 and kv.in_use[b] == 2
    assert torch.equal(kv.req_to_token_pool.req_to_token, rows)
    assert kv.grow_all([a], [9])  # one of them still fits
    assert rows[a.req_pool_idx, :8].tolist() == kv.req_to_token_pool.req_to_token[a.req_pool_idx, :8].tolist()
    assert kv.req_to_token_pool.req_to_token[a.req_pool_idx, :12].tolist() == slots_of(kv, a, 12)
    kv.check_conservation(5)
