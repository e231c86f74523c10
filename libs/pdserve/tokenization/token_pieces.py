"""The bytes and the text of single tokens, for logprobs (OpenAI's ``bytes`` and ``token`` fields).

Decoding one token alone loses what it is when it holds part of a UTF-8 character: byte-level BPE
pieces of an emoji all decode to U+FFFD, so top alternatives collapse into duplicates. A token's
real bytes come from its vocabulary piece instead: byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen)
maps each byte to a printable character, which ``bytes_to_unicode`` inverts; SentencePiece writes
a space as U+2581 and a byte it has no piece for as ``<0xNN>`` (byte fallback). A token's text is
its bytes as UTF-8, with a partial character escaped as ``\\xNN`` (as OpenAI shows such tokens), so
distinct tokens have distinct texts; added and special tokens are their own text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_SPACE = "\u2581"


@dataclass(frozen=True, slots=True)
class TokenPiece:
    """One token: ``data`` its bytes, ``text`` those bytes as text (partial characters as ``\\xNN``)."""

    text: str
    data: bytes


class TokenPieces:
    """Token id -> ``TokenPiece`` for one Hugging Face tokenizer (read-only after construction)."""

    def __init__(self, hf: PreTrainedTokenizerBase) -> None:
        self.hf = hf
        self._added = {i for i in hf.added_tokens_decoder}
        self._byte_level = _has_decoder(hf, "ByteLevel")
        self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}

    def get(self, token_id: int) -> TokenPiece:
        """The piece of ``token_id`` (in ``[0, vocab_size)``; checked by the caller)."""
        raw = self.hf.convert_ids_to_tokens(token_id)
        if token_id in self._added or raw is None:
            data = self.hf.decode([token_id], skip_special_tokens=False).encode()
        elif self._byte_level and all(c in self._byte_decoder for c in raw):
            data = bytes(self._byte_decoder[c] for c in raw)
        elif match := _BYTE_FALLBACK.fullmatch(raw):
            data = bytes([int(match.group(1), 16)])
        elif _SENTENCEPIECE_SPACE in raw:
            data = raw.replace(_SENTENCEPIECE_SPACE, " ").encode()
        else:
            data = self.hf.decode([token_id], skip_special_tokens=False).encode()
        return TokenPiece(data.decode("utf-8", errors="backslashreplace"), data)


def _has_decoder(hf: PreTrainedTokenizerBase, kind: str) -> bool:
    """Whether a fast tokenizer's decoder is (or contains) a decoder of type ``kind``."""
    if not hf.is_fast:
        return False
    decoder = json.loads(hf.backend_tokenizer.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == kind for part in parts)
