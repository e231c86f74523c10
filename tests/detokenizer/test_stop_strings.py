"""Stop strings on streamed text, real SmolLM2 tokenizer; references computed by brute force on the text."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.detokenize import DecodeOptions, IncrementalDetokenizer, TextDelta, TokenStep
from pdserve.tokenization import Tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. 你好世界, bye!"
FFFD = "\ufffd"


def stream(
    tokenizer: Tokenizer,
    ids: list[int],
    stop: list[str],
    include: bool = False,
    chunk: int = 1,
    min_new_tokens: int = 0,
) -> list[TextDelta]:
    """Feed ``ids`` ``chunk`` at a time (the last chunk finishes the rid); deltas until it finished."""
    detok = IncrementalDetokenizer(tokenizer)
    options = DecodeOptions(
        stop=tuple(stop), include_stop_str_in_output=include, min_new_tokens=min_new_tokens
    )
    deltas = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        delta = detok.step([TokenStep("r", ids[i : i + chunk], last, options if i == 0 else None)])[0]
        if delta is None:
            break
        deltas.append(delta)
    assert detok.num_active == 0
    return deltas


def first_stop(text: str, stops: list[str], after: int = 0) -> tuple[int, str] | None:
    """Brute force: the shortest prefix of ``text`` longer than ``after`` that ends with a stop; the
    longest stop ending there."""
    for end in range(after + 1, len(text) + 1):
        ending = [s for s in stops if s and text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def unsearched_len(tokenizer: Tokenizer, ids: list[int], chunk: int, min_new_tokens: int) -> int:
    """Length of the text made stable by the steps that leave the rid with fewer than
    ``min_new_tokens`` ids: no stop may end in it. Text is stable up to the last step boundary
    whose decode does not end in U+FFFD (a character cut between ids)."""
    fed = [0, *(min(k, len(ids)) for k in range(chunk, len(ids) + chunk, chunk))]  # after each step
    prefixes = (tokenizer.decode(ids[:n]) for n in fed if n < max(min_new_tokens, 1))
    return max(len(text) for text in prefixes if not text.endswith(FFFD))


def expected_output(text: str, stops: list[str], include: bool, after: int = 0) -> tuple[str, str | None]:
    found = first_stop(text, stops, after)
    if found is None:
        return text, None
    end, stop = found
    return text[: end if include else end - len(stop)], stop


def check(
    tokenizer: Tokenizer,
    ids: list[int],
    stops: list[str],
    include: bool = False,
    chunk: int = 1,
    min_new_tokens: int = 0,
) -> None:
    text = tokenizer.decode(ids)
    after = unsearched_len(tokenizer, ids, chunk, min_new_tokens)
    want_text, want_stop = expected_output(text, stops, include, after)
    deltas = stream(tokenizer, ids, stops, include, chunk, min_new_tokens)
    assert "".join(d.text for d in deltas) == want_text
    assert deltas[-1].finished and deltas[-1].matched_stop == want_stop
    assert not any(d.finished for d in deltas[:-1])


def test_stop_spanning_three_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    stop = tokenizer.decode(ids[2:5])  # " brown fox jumps": three tokens
    assert len(tokenizer.encode(stop)) == 3
    deltas = stream(tokenizer, ids, [stop])
    assert "".join(d.text for d in deltas) == TEXT[: TEXT.index(stop)]
    assert deltas[-1].matched_stop == stop and len(deltas) == 5
    assert [d.text for d in deltas[2:]] == ["", "", ""]  # " brown", " fox" held until " jumps" decides


def test_later_listed_stop_that_matches_first_wins(tokenizer: Tokenizer) -> None:
    deltas = stream(tokenizer, tokenizer.encode(TEXT), ["lazy dog", "quick"])
    assert "".join(d.text for d in deltas) == "The "
    assert deltas[-1].matched_stop == "quick"


def test_stop_in_the_very_first_token(tokenizer: Tokenizer) -> None:
    deltas = stream(tokenizer, tokenizer.encode(TEXT), ["Th"])
    assert [(d.text, d.finished, d.matched_stop) for d in deltas] == [("", True, "Th")]


def test_include_stop_str_in_output(tokenizer: Tokenizer) -> None:
    deltas = stream(tokenizer, tokenizer.encode(TEXT), ["fox", "世界"], include=True)
    assert "".join(d.text for d in deltas) == "The quick brown fox"
    deltas = stream(tokenizer, tokenizer.encode(TEXT), ["世界"], include=True)
    assert "".join(d.text for d in deltas) == TEXT[: TEXT.index("世界") + 2]


def test_held_prefix_is_released_when_no_stop_follows(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    deltas = stream(tokenizer, ids, ["brown cat", "bye!!"])
    assert "".join(d.text for d in deltas) == TEXT  # "bye!" held to the end, flushed at finish
    assert (deltas[-1].text, deltas[-1].matched_stop) == ("bye!", None)


def test_multibyte_stop_split_across_byte_pieces(tokenizer: Tokenizer) -> None:
    check(tokenizer, tokenizer.encode(TEXT), ["好世"], chunk=1)
    check(tokenizer, tokenizer.encode(TEXT), ["好世"], chunk=3)


def test_min_new_tokens_ignores_stops_that_end_before(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    quick_end, fox_end = TEXT.index("quick") + 5, TEXT.index("fox") + 3
    assert len(tokenizer.decode(ids[:2])) == quick_end and len(tokenizer.decode(ids[:4])) == fox_end
    for min_new_tokens, want_text, want_stop in [
        (0, "The ", "quick"),
        (2, "The ", "quick"),  # "quick" ends in the 2nd token's text: 2 tokens exist then
        (3, "The quick brown ", "fox"),
        (4, "The quick brown ", "fox"),
        (5, TEXT, None),
    ]:
        deltas = stream(tokenizer, ids, ["quick", "fox"], min_new_tokens=min_new_tokens)
        assert "".join(d.text for d in deltas) == want_text
        assert deltas[-1].finished and deltas[-1].matched_stop == want_stop


def test_stop_that_starts_before_min_new_tokens_and_ends_after_counts(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    stop = tokenizer.decode(ids[2:5])  # " brown fox jumps": tokens 3 to 5
    assert len(tokenizer.encode(stop)) == 3
    for min_new_tokens in (4, 5):
        deltas = stream(tokenizer, ids, [stop], min_new_tokens=min_new_tokens)
        assert [d.text for d in deltas] == ["The", " quick", "", "", ""]  # prefix held back as before
        assert deltas[-1].matched_stop == stop
    deltas = stream(tokenizer, ids, [stop], min_new_tokens=6)
    assert [d.text for d in deltas[:5]] == ["The", " quick", "", "", stop]  # released once it can't stop
    assert "".join(d.text for d in deltas) == TEXT and deltas[-1].matched_stop is None


def test_stop_ignored_before_min_new_tokens_is_not_found_later_in_held_text(tokenizer: Tokenizer) -> None:
    # " quick" (2nd token) completes "quick" too early, and is held back as the start of "quick brown";
    # the 3rd token may only complete a match that ends in its own text.
    deltas = stream(tokenizer, tokenizer.encode(TEXT), ["quick", "quick brown"], min_new_tokens=3)
    assert [d.text for d in deltas] == ["The", " ", ""]
    assert deltas[-1].matched_stop == "quick brown"


@given(
    text=st.text(st.sampled_from("ab c.你é"), min_size=1, max_size=40),
    stops=st.lists(st.text(st.sampled_from("ab c.你é"), min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    chunk=st.integers(1, 3),
    min_new_tokens=st.sampled_from([0, 0, 1, 2, 3, 5, 8, 13, 40]),
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_stream_matches_brute_force(
    tokenizer: Tokenizer, text: str, stops: list[str], include: bool, chunk: int, min_new_tokens: int
) -> None:
    check(tokenizer, tokenizer.encode(text), stops, include, chunk, min_new_tokens)
