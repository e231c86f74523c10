"""A draft model's own KV: a request slot and pages per request in the draft runner's pools, and the
token ids whose KV they hold, kept in step with the target's verified tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.mem_cache.memory_pool import slots_for_pages


@dataclass(slots=True)
class DraftSeq:
    """One request's draft KV.

    Attributes:
        slot: its row of the draft's ``req_to_token``.
        pages: its draft KV pages: position ``p`` in ``pages[p // page_size]``.
        ids: the tokens whose KV those pages hold, positions ``0 .. len(ids) - 1``: the verified
            ones (``num_verified``), then drafts of the last step that may have been rejected.
        num_verified: how many of ``ids`` are known to equal the request's verified tokens.
    """

    slot: int
    pages: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    num_verified: int = 0


class DraftKV:
    """Request slots and pages of a draft runner (its ``req_to_token_pool`` and allocator), by rid.

    Args:
        runner: the draft's ``ModelRunner``.
    """

    def __init__(self, runner) -> None:
        self.runner = runner
        self.page_size = runner.token_to_kv_pool_allocator.page_size
        self.seqs: dict[str, DraftSeq] = {}

    def get(self, rid: str) -> DraftSeq | None:
        """``rid``'s draft KV (a fresh one), or None when the draft has no request slot free."""
        seq = self.seqs.get(rid)
        if seq is None:
            slot = self.runner.req_to_token_pool.alloc()
            if slot is None:
                return None
            seq = self.seqs[rid] = DraftSeq(slot)
        return seq

    def sync(self, seq: DraftSeq, prompt: Sequence[int], outputs: Sequence[int]) -> int:
        """Keep the KV of the longest prefix of ``seq.ids`` that is the request's verified sequence
        (``prompt + outputs``), never its last token (the next forward computes it, for its logits);
        frees the pages beyond. Returns how many tokens of KV are kept."""
        n = len(prompt) + len(outputs) - 1
        keep = min(seq.num_verified, n)
        while keep < min(len(seq.ids), n) and seq.ids[keep] == _token_at(prompt, outputs, keep):
            keep += 1
        self.truncate(seq, keep)
        seq.num_verified = keep
        return keep

    def truncate(self, seq: DraftSeq, num_tokens: int) -> None:
        """Keep KV for positions ``[0, num_tokens)`` only: the pages wholly beyond go back."""
        keep = -(-num_tokens // self.page_size)
        self.runner.token_to_kv_pool_allocator.free(seq.pages[keep:])
        del seq.pages[keep:], seq.ids[num_tokens:]

    def reserve(self, seq: DraftSeq, num_tokens: int) -> bool:
        """Pages for positions ``[0, num_tokens)`` (their slots written into ``req_to_token``);
        False, taking none, when the draft pool is short."""
        need = -(-num_tokens // self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        pages = self.runner.token_to_kv_pool_allocator.alloc(need)
        if pages is None:
            return False
        start = len(seq.pages) * self.page_size
        seq.pages += pages
        end = len(seq.pages) * self.page_size
        slots = slots_for_pages(seq.pages, start, end, self.page_size)
        self.runner.req_to_token_pool.req_to_token[seq.slot, start:end] = slots.to(self.runner.device)
        return True

    def release(self, rid: str) -> None:
        """Give back ``rid``'s slot and pages (no-op for an unknown rid)."""
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self.runner.token_to_kv_pool_allocator.free(seq.pages)
            self.runner.req_to_token_pool.free(seq.slot)

    def pages_in_use(self) -> int:
        return sum(len(seq.pages) for seq in self.seqs.values())


def _token_at(prompt: Sequence[int], outputs: Sequence[int], position: int) -> int:
    return prompt[position] if position < len(prompt) else outputs[position - len(prompt)]
