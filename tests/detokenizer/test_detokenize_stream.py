"""Streamed deltas of the incremental detokenizer against one transformers decode of all ids.

Properties, for ids fed one to three at a time, several rids per batch:
- the deltas of a rid concatenate to ``hf.decode(all ids)`` (same skip_special_tokens);
- the text sent so far is always a prefix of that final text (nothing sent is ever revised, so no
  U+FFFD of a character split across tokens reaches a client), and no delta but the last ends in
  U+FFFD;
- for ids of valid text (CJK, emoji, one byte-level piece per UTF-8 byte, special tokens between
  characters) no delta contains U+FFFD at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pdserve.detokenize import DecodeOptions, IncrementalDetokenizer, TextDelta, TokenStep
from pdserve.tokenization import Tokenizer

FFFD = "\ufffd"
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

cjk = st.text(st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), min_size=1, max_size=12)
emoji = st.text(
    st.one_of(
        st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), st.sampled_from(" ab\u200d\ufe0f")
    ),
    min_size=1,
    max_size=12,
)
any_text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters=FFFD), min_size=1, max_size=12)


@dataclass
class Case:
    ids: list[int]
    valid: bool  # the ids decode to valid UTF-8 (no U+FFFD expected anywhere)


@functools.cache
def byte_piece_ids(tokenizer: Tokenizer) -> dict[int, int]:
    """Byte value -> id of the byte-level token holding just that byte (bytes the vocab has)."""
    ids = tokenizer.hf.convert_tokens_to_ids([bytes_to_unicode()[b] for b in range(256)])
    return {b: i for b, i in enumerate(ids) if i != tokenizer.hf.unk_token_id}


@st.composite
def cases(draw: st.DrawFn, tokenizer: Tokenizer) -> Case:
    kind = draw(st.sampled_from(["random", "cjk", "emoji", "bytes", "mixed"]))
    vocab = tokenizer.info.vocab_size
    if kind == "random":
        return Case(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=30)), valid=False)
    pieces = byte_piece_ids(tokenizer)
    # Text whose every UTF-8 byte has a byte-level token (this vocab lacks a few, e.g. 0x04).
    representable = any_text.filter(lambda t: set(t.encode()) <= pieces.keys())
    if kind == "bytes":
        return Case([pieces[b] for b in draw(representable).encode()], valid=True)
    segment = {"cjk": cjk, "emoji": emoji, "mixed": st.one_of(cjk, emoji, representable)}[kind]
    special = st.sampled_from(tokenizer.hf.all_special_ids)
    parts = draw(
        st.lists(
            st.one_of(segment.map(lambda t: tokenizer.encode(t, False)), special.map(lambda i: [i])),
            min_size=1,
            max_size=5,
        )
    )
    return Case([i for part in parts for i in part], valid=True)


@st.composite
def chunked(draw: st.DrawFn, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = draw(st.integers(1, 3))
        chunks.append(ids[i : i + n])
        i += n
    if draw(st.booleans()):
        chunks.append([])  # the finish may arrive with no new ids
    return chunks


@given(data=st.data())
@SETTINGS
def test_stream_equals_full_decode(tokenizer: Tokenizer, data: st.DataObject) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    rids = [f"r{k}" for k in range(data.draw(st.integers(1, 4), label="num rids"))]
    cases_ = {rid: data.draw(cases(tokenizer), label=rid) for rid in rids}
    options = {
        rid: DecodeOptions(
            skip_special_tokens=data.draw(st.booleans()),
            spaces_between_special_tokens=data.draw(st.booleans()),
        )
        for rid in rids
    }
    chunks = {rid: data.draw(chunked(cases_[rid].ids)) for rid in rids}
    expected = {
        rid: tokenizer.hf.decode(
            cases_[rid].ids,
            skip_special_tokens=options[rid].skip_special_tokens,
            spaces_between_special_tokens=options[rid].spaces_between_special_tokens,
        )
        for rid in rids
    }
    sent = {rid: "" for rid in rids}
    deltas: dict[str, list[str]] = {rid: [] for rid in rids}
    for step in range(max(len(c) for c in chunks.values())):
        batch = [
            TokenStep(
                rid, chunks[rid][step], step == len(chunks[rid]) - 1, options[rid] if step == 0 else None
            )
            for rid in rids
            if step < len(chunks[rid])
        ]
        for item, delta in zip(batch, detok.step(batch), strict=True):
            assert delta is not None and delta.rid == item.rid
            assert delta.finished == item.finish and delta.matched_stop is None
            sent[item.rid] += delta.text
            deltas[item.rid].append(delta.text)
            assert expected[item.rid].startswith(sent[item.rid])
    assert detok.num_active == 0
    for rid in rids:
        assert sent[rid] == expected[rid]
        assert not any(d.endswith(FFFD) for d in deltas[rid][:-1])
        if cases_[rid].valid:
            assert FFFD not in sent[rid]


def test_split_character_is_held_until_complete(tokenizer: Tokenizer) -> None:
    pieces = byte_piece_ids(tokenizer)
    ids = [pieces[b] for b in "a😀".encode()]  # 'a' then the four bytes F0 9F 98 80
    detok = IncrementalDetokenizer(tokenizer)
    texts = [
        detok.step([TokenStep("r", [i], i == ids[-1], DecodeOptions() if i == ids[0] else None)])[0].text
        for i in ids
    ]
    assert texts == ["a", "", "", "", "😀"]


def test_finish_flushes_an_incomplete_character_like_a_full_decode(tokenizer: Tokenizer) -> None:
    pieces = byte_piece_ids(tokenizer)
    ids = [pieces[b] for b in "b😀".encode()[:3]]  # 'b' and three of the emoji's four bytes
    detok = IncrementalDetokenizer(tokenizer)
    first = detok.step([TokenStep("r", ids[:1], options=DecodeOptions())])[0]
    held = detok.step([TokenStep("r", ids[1:2])])[0]
    last = detok.step([TokenStep("r", ids[2:], finish=True)])[0]
    assert (first.text, held.text, last.finished) == ("b", "", True)
    assert first.text + last.text == tokenizer.hf.decode(ids)
    assert last.text.endswith(FFFD)


def test_ids_without_a_state_are_ignored_and_options_open_a_fresh_one(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("hello there")
    assert detok.step([TokenStep("unknown", ids)]) == [None]
    stop = DecodeOptions(stop=(" there",))
    assert detok.step([TokenStep("r", ids, options=stop)])[0] == TextDelta("r", "hello", True, " there")
    assert detok.step([TokenStep("r", ids)]) == [None]  # late ids after the stop
    again = detok.step([TokenStep("r", ids[:1], options=DecodeOptions())])[0]  # the rid is reused
    assert (again.text, again.finished, detok.num_active) == ("hello", False, 1)


def test_bad_batch_changes_nothing(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    for batch in (
        [TokenStep("a", [5], options=DecodeOptions()), TokenStep("a", [6])],
        [TokenStep("a", [5], options=DecodeOptions()), TokenStep("b", [-1], options=DecodeOptions())],
    ):
        with pytest.raises(ValueError):
            detok.step(batch)
        assert detok.num_active == 0
