"""The text of single token ids, for OpenAI logprobs (``"token"`` and ``"bytes"`` fields).

The gateway holds no tokenizer: each id is decoded once by the tokenizer service
(``Detokenize([id])`` with special tokens kept) and remembered; the vocabulary bounds the cache.
A byte-level BPE token that is only part of a UTF-8 character decodes to U+FFFD, as it does in
vLLM's and SGLang's logprobs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable


class TokenTexts:
    """id -> token text cache over an async ``decode_one(id) -> str``."""

    def __init__(self, decode_one: Callable[[int], Awaitable[str]]) -> None:
        self._decode_one = decode_one
        self._texts: dict[int, str] = {}

    async def get(self, ids: Iterable[int]) -> dict[int, str]:
        """Texts of ``ids`` (missing ones fetched concurrently). Raises what ``decode_one`` raises."""
        wanted = set(ids)
        missing = [i for i in wanted if i not in self._texts]
        if missing:
            texts = await asyncio.gather(*(self._decode_one(i) for i in missing))
            self._texts.update(zip(missing, texts, strict=True))
        return {i: self._texts[i] for i in wanted}
