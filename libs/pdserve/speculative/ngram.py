"""N-gram drafting (prompt lookup): guess that the text goes on as it did after the last time its
current ending occurred in the request's own prompt and output.

As SGLang's NGRAM and vLLM's ``ngram`` proposer (prompt lookup decoding, Saxena 2023) do: take the
longest suffix of the sequence, of ``max_n`` down to ``min_n`` tokens, that occurred earlier, and
propose the ``k`` tokens that followed its most recent earlier occurrence, repeating that span when
it reaches the present. Input-grounded outputs (quoting, extracting or editing the prompt; code)
repeat long spans, which such drafts get right, and a small model's loops repeat themselves.

Which occurrence and how to continue, replayed on SmolLM2's greedy outputs (float32+w4a8, 32
prompts each of ``benchmarks.serving_lib.workload``, 64 tokens, 1..4-grams, k = 4; tokens per
verify step): the most recent occurrence, continued with itself, 2.47 on grounded prompts and 3.40
on random ones; without continuing 2.39 and 1.91 (a loop ``x x x`` drafted one token); the earliest
occurrence 2.39-2.40 and 2.99-3.16. Matching from 2-grams drafts in fewer steps, at a higher
acceptance rate (0.64 vs 0.51 grounded) but fewer tokens a step (2.24).

Each request keeps an index, ``n-gram -> position after its most recent occurrence``, updated with
the tokens appended since the last step (``max_n - min_n + 1`` dictionary writes per token), so a
proposal is at most ``max_n - min_n + 1`` lookups: microseconds per request, in pure Python. The
index holds ``max_n - min_n + 1`` entries per token of the request (a few hundred bytes per token).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.speculative.proposer import DraftRequest, Drafts, Proposer


class NgramIndex:
    """Where each n-gram (``min_n <= n <= max_n`` tokens) of a growing sequence last occurred.

    ``table[ngram]`` is the position right after that n-gram's most recent occurrence whose next
    token is known, i.e. an occurrence that does not end at the sequence's last token.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens``: the n-grams ending just before each of them now have a known follower."""
        seq, table = self.tokens, self.table
        for token in tokens:
            t = len(seq)  # position of the new token: the n-grams ending at t - 1 are followed by it
            for n in range(self.min_n, min(self.max_n, t) + 1):
                table[tuple(seq[t - n : t])] = t
            seq.append(token)

    def propose(self, k: int) -> list[int]:
        """``k`` tokens that followed the most recent earlier occurrence of the longest suffix that
        occurred before (none when no suffix of ``min_n`` tokens or more did). A continuation that
        reaches the sequence's end goes on with itself: the text repeats with the period from that
        occurrence to now (a loop ``a b a b`` drafts ``a b a b``, not just ``a``)."""
        seq = self.tokens
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            start = self.table.get(tuple(seq[len(seq) - n :]))
            if start is not None:
                period = len(seq) - start
                return [seq[start + i % period] for i in range(k)]
        return []


class NgramProposer(Proposer):
    """Drafts from each request's own prompt and output (``NgramIndex``), with no model.

    Args:
        min_n / max_n: the shortest and longest suffix matched (``1 <= min_n <= max_n``).

    Raises:
        ValueError: bad ``min_n`` / ``max_n``.
    """

    drafts_are_free = True  # index lookups, no model

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, reqs: Sequence[DraftRequest]) -> Drafts:
        return Drafts([self._index(req).propose(req.num_drafts) for req in reqs])

    def release(self, rid: str) -> None:
        self._indexes.pop(rid, None)

    def _index(self, req: DraftRequest) -> NgramIndex:
        """``req``'s index, brought up to its prompt and outputs (rebuilt if they are not what it
        indexed before: a new request under a reused rid)."""
        index = self._indexes.get(req.rid)
        prompt, outputs = req.prompt_ids, req.output_ids
        done = 0 if index is None else len(index.tokens)
        if index is None or done < len(prompt) or done > len(prompt) + len(outputs):
            index = self._indexes[req.rid] = NgramIndex(self.min_n, self.max_n)
            index.extend(prompt)
            done = len(prompt)
        index.extend(outputs[done - len(prompt) :])
        return index
