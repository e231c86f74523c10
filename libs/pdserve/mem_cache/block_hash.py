"""The KV block hash: one 64-bit name per KV page of a token prefix, the same in every process.

A block is one KV page (``page_size`` token ids). Its hash chains from its parent's, as vLLM's
prefix-caching block hashes do (vLLM, ``vllm/v1/core/kv_cache_utils.py``: ``hash((parent, tokens))``),
so a hash names the whole prefix up to and including its block, not the block's tokens alone.
vLLM's builtin-``hash`` variant differs between processes; this one is defined by bytes:

    block_hash(parent, tokens) = little-endian uint64 of
        BLAKE2b(digest_size=8, person=b"pdserve-kv-v1")(
            (parent as 8 little-endian bytes, absent for a prefix's first block)
            + (each token id as 4 little-endian bytes, unsigned))

A scheduler names the blocks it caches with it (``RadixCache``'s KV events) and a router names a
prompt's blocks with it (:func:`block_hashes`), so both agree without sharing any state.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

PERSON = b"pdserve-kv-v1"


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """The hash (an int in ``[0, 2**64)``) of the block ``token_ids`` after the block ``parent``
    (None: the first block of a prefix).

    Raises:
        ValueError: no token ids, a token id outside ``[0, 2**32)``, or ``parent`` outside
            ``[0, 2**64)``.
    """
    if not token_ids:
        raise ValueError("a block needs at least one token id")
    (digest,) = _chain(_pack(parent, token_ids), len(token_ids))
    return int.from_bytes(digest, "little")


def block_hashes(token_ids: Sequence[int], page_size: int, parent: int | None = None) -> list[int]:
    """The chained hashes of every whole page of ``token_ids`` (a trailing partial page has none),
    the first one's parent being ``parent``: ``len(token_ids) // page_size`` ints. About 2 us a
    16-token page (CPython 3.11, Sapphire Rapids).

    Raises:
        ValueError: ``page_size < 1``, or as :func:`block_hash`.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    whole = token_ids[: len(token_ids) // page_size * page_size]
    return [int.from_bytes(digest, "little") for digest in _chain(_pack(parent, whole), page_size)]


def _pack(parent: int | None, token_ids: Sequence[int]) -> tuple[bytes, bytes]:
    """``parent``'s 8 bytes (empty for None) and the token ids' 4 bytes each, little-endian."""
    try:
        head = b"" if parent is None else struct.pack("<Q", parent)
        return head, struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as e:
        raise ValueError(f"cannot hash block (parent {parent}, token ids {list(token_ids)}): {e}") from e


def _chain(packed: tuple[bytes, bytes], page_size: int) -> list[bytes]:
    """The digests of ``packed``'s pages, each hashed after the digest before it (a digest's bytes
    are its hash's little-endian bytes)."""
    previous, data = packed
    step = 4 * page_size
    digests = []
    for start in range(0, len(data), step):
        previous = hashlib.blake2b(
            previous + data[start : start + step], digest_size=8, person=PERSON
        ).digest()
        digests.append(previous)
    return digests


def namespace_hash(namespace: str) -> int:
    """The parent hash (an int in ``[0, 2**64)``) of the first blocks of a LoRA adapter's prefixes
    (``namespace``: its name): BLAKE2b (8 bytes, person ``pdserve-lora-v1``) of the UTF-8 name."""
    digest = hashlib.blake2b(namespace.encode(), digest_size=8, person=b"pdserve-lora-v1").digest()
    return int.from_bytes(digest, "little")
