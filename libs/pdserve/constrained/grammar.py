"""``Grammar``: one request's position in its grammar, and the masking of a batch's logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Grammar:
    """A request's xgrammar matcher: which tokens may come next, advanced by each kept token.

    The scheduler calls ``accept`` with every token the request keeps (on the loop thread); the
    sampler calls ``fill_bitmask`` before it samples the request's next token. A token the grammar
    refuses leaves ``rejected`` set (it cannot happen to a token sampled under this grammar's mask;
    in PD it would mean the prefill worker's grammar differed).

    A retracted request keeps its tokens (it recomputes their KV), so its matcher stays where it is.
    """

    def __init__(self, matcher) -> None:
        self._matcher = matcher
        self.rejected: int | None = None  # the token the grammar refused, if any

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and ``rejected`` set) if the grammar does not allow it."""
        if self.rejected is not None or not self._matcher.accept_token(token):
            self.rejected = token if self.rejected is None else self.rejected
            return False
        return True

    @property
    def terminated(self) -> bool:
        """The grammar is complete and has accepted its stop token: nothing may follow."""
        return self._matcher.is_terminated()

    def masks_along(self, draft: list[int], vocab_size: int) -> list[PositionMask]:
        """The masks of the positions of a draft (speculative decoding): mask ``j`` is the grammar's
        after ``draft[:j]``, for ``j`` up to the first draft token it refuses (excluded) or the one
        that ends it (included), so ``len(result) - 1`` draft tokens stand. The matcher is rolled
        back to where it was (xgrammar's ``rollback``); none stand for an ended grammar."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(draft) + 1, vocab_size)
        accepted = 0
        for j in range(len(draft) + 1):
            self.fill_bitmask(bitmask, j)
            ended = self.rejected is not None or self._matcher.is_terminated()
            if j == len(draft) or ended or not _allowed(bitmask[j], draft[j], vocab_size):
                break
            self._matcher.accept_token(draft[j])
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return [PositionMask(bitmask[j]) for j in range(accepted + 1)]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, bit ``t % 32`` of word
        ``t // 32`` set when token ``t`` is allowed). A grammar that has ended (or refused a token)
        leaves the row as it is (all allowed): the request is finished and a token sampled for it
        (an overlapped loop may have scheduled it once more) is discarded."""
        if self.rejected is None and not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)


class PositionMask:
    """The mask of one position of a draft, computed ahead (``Grammar.masks_along``); the sampler
    reads it as it reads a ``Grammar``."""

    def __init__(self, words: torch.Tensor) -> None:
        self.words = words  # int32 [ceil(V / 32)]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.words


def _allowed(words: torch.Tensor, token: int, vocab_size: int) -> bool:
    """Whether ``token``'s bit is set in a bitmask row (bit ``t % 32`` of word ``t // 32``)."""
    return 0 <= token < vocab_size and bool((int(words[token // 32]) >> (token % 32)) & 1)


def apply_grammars(logits: torch.Tensor, grammars: Sequence[Grammar | PositionMask | None]) -> list[int]:
    """Set to -inf, in place, the logits of every token the row's grammar does not allow next.

    Args:
        logits: float32 ``[B, V]`` (any device); rows without a grammar are left alone.
        grammars: one entry per row (a request's ``Grammar``, or a draft position's
            ``PositionMask``), None for unconstrained rows.

    Returns:
        the indices of the constrained rows.
    """
    import xgrammar as xgr

    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return rows
    bitmask = xgr.allocate_token_bitmask(len(grammars), logits.shape[-1])
    for i in rows:
        grammars[i].fill_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), vocab_size=logits.shape[-1], indices=rows
    )
    return rows
