"""A migrated request's continuation on a fresh decode state (``TokenStep.resumed``): at every cut,
the text sent before the cut plus the continuation's text equals one uninterrupted stream's, with a
multi-byte character and stop strings straddling the cut. Real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from pdserve.detokenize import DecodeOptions, IncrementalDetokenizer, TokenStep
from pdserve.tokenization import Tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. 你好世界, bye now!"


def run(
    tokenizer: Tokenizer, ids: list[int], options: DecodeOptions, resumed: list[int] = ()
) -> tuple[str, str]:
    """Stream ``ids`` one id a step (the last finishes the rid) on a state that resumes after
    ``resumed``; returns (text, matched stop or "")."""
    detok = IncrementalDetokenizer(tokenizer)
    text, stop = "", ""
    for i, token in enumerate(ids):
        first = options if i == 0 else None
        delta = detok.step([TokenStep("r", [token], i == len(ids) - 1, first, resumed if i == 0 else ())])[0]
        if delta is None:
            break
        text += delta.text
        stop = delta.matched_stop or stop
    return text, stop


def sent_before(tokenizer: Tokenizer, ids: list[int], options: DecodeOptions, cut: int) -> str:
    """The text an uninterrupted stream had sent once it took ``ids[:cut]`` (not finished)."""
    detok = IncrementalDetokenizer(tokenizer)
    text = ""
    for i in range(cut):
        delta = detok.step([TokenStep("r", [ids[i]], False, options if i == 0 else None)])[0]
        text += delta.text
    return text


@pytest.mark.parametrize("stop", [(), ("lazy dog",), ("世界",), ("bye now",)])
def test_a_continuation_sends_exactly_the_rest_of_the_text_at_every_cut(tokenizer: Tokenizer, stop) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    options = DecodeOptions(stop=stop)
    whole, whole_stop = run(tokenizer, ids, options)
    assert whole == (TEXT.split(stop[0])[0] if stop else TEXT)
    # a cut after the stop's last token is past the request's end (no migration from there)
    end = next((n for n in range(1, len(ids) + 1) if stop and stop[0] in tokenizer.decode(ids[:n])), len(ids))
    for cut in range(1, end):
        before = sent_before(tokenizer, ids, options, cut)
        rest, rest_stop = run(tokenizer, ids[cut:], options, ids[:cut])
        assert before + rest == whole, cut
        assert rest_stop == whole_stop, cut
