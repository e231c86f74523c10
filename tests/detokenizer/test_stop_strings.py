"""Stop strings on streamed text, real SmolLM2 tokenizer; references computed by brute force on the text."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.detokenize import DecodeOptions, IncrementalDetokenizer, TextDelta, TokenStep
from pdserve.tokenization import Tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. 你好世界, bye!"


def stream(
    tokenizer: Tokenizer, ids: list[int], stop: list[str], include: bool = False, chunk: int = 1
) -> list[TextDelta]:
    """Feed ``ids`` ``chunk`` at a time (the last chunk finishes the rid); deltas until it finished."""
    detok = IncrementalDetokenizer(tokenizer)
    options = DecodeOptions(stop=tuple(stop), include_stop_str_in_output=include)
    deltas = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        delta = detok.step([TokenStep("r", ids[i : i + chunk], last, options if i == 0 else None)])[0]
        if delta is None:
            break
        deltas.append(delta)
    assert detok.num_active == 0
    return deltas


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Brute force: the shortest prefix of ``text`` that contains a stop; the longest stop ending there."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if s and text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def expected_output(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    found = first_stop(text, stops)
    if found is None:
        return text, None
    end, stop = found
    return text[: end if include else end - len(stop)], stop


def check(
    tokenizer: Tokenizer, ids: list[int], stops: list[str], include: bool = False, chunk: int = 1
) -> None:
    text = tokenizer.decode(ids)
    want_text, want_stop = expected_output(text, stops, include)
    deltas = stream(tokenizer, ids, stops, include, chunk)
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


@given(
    text=st.text(st.sampled_from("ab c.你é"), min_size=1, max_size=40),
    stops=st.lists(st.text(st.sampled_from("ab c.你é"), min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    chunk=st.integers(1, 3),
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_stream_matches_brute_force(
    tokenizer: Tokenizer, text: str, stops: list[str], include: bool, chunk: int
) -> None:
    check(tokenizer, tokenizer.encode(text), stops, include, chunk)
