"""The NIXL notification messages of a KV transfer (bytes; the transfer id ``tid`` goes last, verbatim).

- ``LANDED`` (sender → receiver, attached to a WRITE, so it arrives after the WRITE's bytes):
  ``count`` pages for destination indices ``[first, first + count)`` of transfer ``tid`` are in the
  destination pages.
- ``ABORT`` (sender → receiver): transfer ``tid`` failed on the sending side; no more pages come.
"""

from __future__ import annotations

from typing import NamedTuple

LANDED, ABORT = b"L", b"X"


class Landed(NamedTuple):
    tid: bytes
    first: int
    count: int


def landed(tid: bytes, first: int, count: int) -> bytes:
    return b"%s %d %d %s" % (LANDED, first, count, tid)


def abort(tid: bytes) -> bytes:
    return ABORT + b" " + tid


def parse(msg: bytes) -> tuple[bytes, Landed | bytes]:
    """``(kind, body)``: a ``Landed`` for LANDED, the tid for ABORT.

    Raises:
        ValueError: not a message of this protocol.
    """
    kind, _, rest = msg.partition(b" ")
    if kind == LANDED:
        first, count, tid = rest.split(b" ", 2)
        return kind, Landed(tid, int(first), int(count))
    if kind == ABORT and rest:
        return kind, rest
    raise ValueError(f"not a KV transfer message: {msg[:64]!r}")
