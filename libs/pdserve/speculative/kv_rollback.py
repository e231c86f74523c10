"""Giving back the KV of rejected draft tokens after a verify step.

A verify step writes KV for a request's last token and its ``k`` drafts, at positions
``L .. L + k`` (slots of pages the scheduler grew for them); the request keeps ``a`` drafts, so KV
stays valid for positions ``[0, L + a + 1)`` only. ``rollback`` makes that the request's computed
length (``Req.num_computed``, from which the ledger takes the tokens it may put in the radix cache,
so the cache never holds an unverified token) and frees the pages wholly beyond it in the same step.
The rejected slots inside the kept last page are simply written again by the next step.

What the scheduler's ``KVLedger`` would gain to own this (``pdserve.scheduler.kv_ledger``): one
method, ``truncate(req, num_tokens) -> list[int]``, doing what ``rollback`` does with the ledger's
allocator and its ``in_use`` count; until then this function does it through those attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.scheduler.kv_ledger import KVLedger
    from pdserve.scheduler.req import Req


def rollback(ledger: KVLedger, req: Req, num_valid: int) -> list[int]:
    """Keep ``req``'s KV for positions ``[0, num_valid)``: set ``req.num_computed`` to it and free the
    pages it owns wholly beyond (radix-cache prefix pages are never among them). Returns the freed
    pages. ``req_to_token`` entries past ``num_valid`` stay stale: nothing reads beyond a length.

    Call it when the verify step's result is processed, before anything caches the request's KV,
    and only while no other scheduled batch holds the request (the overlap loop must not have
    scheduled it again: its positions depend on how many drafts are kept).

    Raises:
        ValueError: ``num_valid`` beyond the computed tokens, or inside the radix-cache prefix.
    """
    if not req.num_prefix_pages * ledger.page_size <= num_valid <= req.num_computed:
        raise ValueError(
            f"rid {req.rid}: cannot keep {num_valid} tokens of KV: {req.num_computed} computed, "
            f"{req.num_prefix_pages * ledger.page_size} in the radix-cache prefix"
        )
    keep = ledger.pages_for(num_valid)
    freed = req.pages[keep:]
    if freed:
        ledger.allocator.free(freed)
        del req.pages[keep:]
        ledger.in_use[req] -= len(freed)
    req.num_computed = num_valid
    return freed
