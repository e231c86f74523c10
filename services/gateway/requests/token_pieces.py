"""The text and bytes of single token ids, for OpenAI logprobs (``"token"`` and ``"bytes"`` fields).

The gateway holds no tokenizer: the tokenizer service gives each id's piece (``GetTokenPieces``:
the token's real bytes, and its text with a partial UTF-8 character as ``\\xNN`` escapes, so that
distinct alternatives stay distinct), fetched once per id and remembered; the vocabulary bounds the
cache.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from pdserve.services.gateway.io_struct import TokenPiece


class TokenPieces:
    """id -> ``TokenPiece`` cache over an async ``fetch(ids) -> pieces`` (same order)."""

    def __init__(self, fetch: Callable[[list[int]], Awaitable[list[TokenPiece]]]) -> None:
        self._fetch = fetch
        self._pieces: dict[int, TokenPiece] = {}

    async def get(self, ids: Iterable[int]) -> dict[int, TokenPiece]:
        """Pieces of ``ids`` (the missing ones fetched in one call). Raises what ``fetch`` raises."""
        wanted = set(ids)
        missing = [i for i in wanted if i not in self._pieces]
        if missing:
            self._pieces.update(zip(missing, await self._fetch(missing), strict=True))
        return {i: self._pieces[i] for i in wanted}
