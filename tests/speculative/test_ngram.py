"""N-gram drafting: the longest earlier suffix match, its most recent occurrence, and an index kept
up to date one step at a time equal to one built at once."""

from __future__ import annotations

import random

import pytest

from pdserve.speculative.ngram import NgramIndex, NgramProposer
from pdserve.speculative.proposer import DraftRequest


def index_of(tokens: list[int], min_n: int = 1, max_n: int = 4) -> NgramIndex:
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The specification: for n from max_n down to min_n, the last earlier occurrence of the final n
    tokens (one that ends before the last token), and the k tokens after it, the text that followed
    it going on as it went on (a copy of the tokens drafted so far) once it reaches the present."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                text = list(tokens)
                for i in range(k):
                    text.append(text[start + n + i])
                return text[len(tokens) :]
    return []


def test_the_longest_suffix_wins_over_a_later_shorter_one():
    #        the 3-gram (5, 6, 7) occurred at 0; the 1-gram (7) occurred later, at 9
    tokens = [5, 6, 7, 8, 9, 10, 1, 1, 1, 7, 2, 5, 6, 7]
    assert index_of(tokens).propose(3) == [8, 9, 10]
    assert index_of(tokens, max_n=1).propose(3) == [2, 5, 6]  # the most recent 7


def test_a_continuation_that_reaches_the_present_repeats_itself():
    assert index_of([4, 4, 4, 4]).propose(5) == [4] * 5  # after 4 4 4 at 0 came a 4: a loop of 4s
    assert index_of([1, 2, 1, 2, 1]).propose(5) == [2, 1, 2, 1, 2]
    assert index_of([7, 1, 2, 3, 9, 1, 2, 3]).propose(6) == [9, 1, 2, 3, 9, 1]
    assert index_of([3]).propose(2) == [] and index_of([]).propose(2) == []


def test_no_match_below_min_n():
    assert index_of([1, 2, 3, 9, 2, 3], min_n=3).propose(2) == []
    assert index_of([1, 2, 3, 9, 2, 3], min_n=2).propose(2) == [9, 2]
    assert index_of([1, 2, 3, 9, 2, 3], min_n=2).propose(4) == [9, 2, 3, 9]


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 4), (2, 3), (1, 1)])
def test_matches_a_brute_force_search(min_n, max_n):
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(1, 6)
        assert index_of(tokens, min_n, max_n).propose(k) == brute_force(tokens, k, min_n, max_n)


def test_the_proposer_indexes_each_step_s_new_outputs():
    rng = random.Random(1)
    prompt = [rng.randrange(20) for _ in range(50)]
    outputs: list[int] = []
    proposer = NgramProposer(min_n=1, max_n=3)
    for _ in range(30):
        outputs += [rng.randrange(20) for _ in range(rng.randrange(1, 4))]
        drafts = proposer.propose([DraftRequest("a", prompt, outputs, 4)])
        assert drafts.token_ids == [brute_force(prompt + outputs, 4, 1, 3)]
        assert drafts.probs is None
    assert len(proposer._indexes["a"].tokens) == len(prompt) + len(outputs)
    proposer.release("a")
    assert proposer._indexes == {}
    assert proposer.propose([DraftRequest("a", [7, 8, 7], [9], 2)]).token_ids == [[]]  # a new request


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(min_n=0)
