"""OpenAI's legacy completions ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``), built token by token for one choice, its echoed prompt first when scored.

- ``text_offset``: where each token starts in the choice's text, in characters. Each token's bytes
  are decoded incrementally (``TextOffsets``), so a character split over byte-fallback tokens
  (``\\xe2``, ``\\x98``, ...) counts once, at the token that completes it, and the offsets stay
  inside the text (the token texts' lengths would count each ``\\xNN`` escape as four).
- ``top_logprobs``: the ``N`` most likely tokens plus the chosen one when it is not among them (up to
  ``N + 1``, as OpenAI's); ``logprobs`` 0 gives the chosen token alone.
- After a stop string, the tokens of the matched stop text, which the text leaves out, are left out
  too; a stream sends a token's entry with the text it starts in (``split_at``), so it never sends
  one of the stop text, which the detokenizer holds back until it knows.
"""

from __future__ import annotations

import codecs

from pdserve.services.gateway.io_struct import TokenPiece, TopLogprob
from pdserve.services.gateway.openai.protocol_responses import CompletionLogprobs


class TextOffsets:
    """The ``text_offset`` of a choice's next token: characters of the text its tokens made so far."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0

    def take(self, data: bytes) -> int:
        """The offset of the token whose bytes are ``data``; the next token's is past its text."""
        at = self.offset
        self.offset += len(self._decoder.decode(data))
        return at


def append_token(
    out: CompletionLogprobs,
    pieces: dict[int, TokenPiece],
    offsets: TextOffsets,
    token_id: int,
    logprob: float | None,
    top: list[TopLogprob] | None,
) -> None:
    """Append one token (its piece in ``pieces``) with its ``logprob`` and ``top`` alternatives (None
    for both: an echoed prompt's first token, which nothing precedes)."""
    piece = pieces[token_id]
    out.tokens.append(piece.text)
    out.text_offset.append(offsets.take(piece.data))
    out.token_logprobs.append(logprob)
    if top is None:
        out.top_logprobs.append(None)
        return
    entries = {pieces[t.token_id].text: t.logprob for t in top}
    entries.setdefault(piece.text, logprob)  # the chosen token, when outside the top N
    out.top_logprobs.append(entries)


def split_at(out: CompletionLogprobs, text_end: int) -> tuple[CompletionLogprobs, CompletionLogprobs]:
    """``out``'s tokens that start before ``text_end`` (characters of the choice's text), and the
    rest: the tokens of text not released yet (a stream holds them until it is), or of a matched
    stop string, which the text leaves out."""
    keep = sum(1 for offset in out.text_offset if offset < text_end)
    return _sliced(out, slice(None, keep)), _sliced(out, slice(keep, None))


def joined(first: CompletionLogprobs | None, then: CompletionLogprobs) -> CompletionLogprobs:
    """``first``'s tokens (None: none) followed by ``then``'s."""
    if first is None:
        return then
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


def _sliced(out: CompletionLogprobs, part: slice) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=out.tokens[part],
        token_logprobs=out.token_logprobs[part],
        top_logprobs=out.top_logprobs[part],
        text_offset=out.text_offset[part],
    )
