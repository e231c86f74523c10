"""The NIXL notification messages of a KV transfer (bytes; the transfer id ``tid`` goes last, verbatim).

- ``LANDED`` (sender → receiver, attached to a WRITE, so it arrives after the WRITE's bytes):
  ``count`` pages for destination indices ``[first, first + count)`` of transfer ``tid`` are in
  receive slot ``slot`` of the lane the receiver granted this sender, or, with ``slot == -1``,
  already in the destination pages themselves.
- ``ACK`` (receiver → sender): receive slot ``slot`` may be written again.
- ``ABORT`` (sender → receiver): transfer ``tid`` failed on the sending side; no more pages come.
"""

from __future__ import annotations

from typing import NamedTuple

LANDED, ACK, ABORT = b"L", b"A", b"X"
DIRECT = -1
"""``slot`` of a LANDED message whose pages were written straight into the destination pages."""


class Landed(NamedTuple):
    tid: bytes
    first: int
    count: int
    slot: int


def landed(tid: bytes, first: int, count: int, slot: int) -> bytes:
    return b"%s %d %d %d %s" % (LANDED, first, count, slot, tid)


def ack(slot: int) -> bytes:
    return b"%s %d" % (ACK, slot)


def abort(tid: bytes) -> bytes:
    return ABORT + b" " + tid


def parse(msg: bytes) -> tuple[bytes, Landed | int | bytes]:
    """``(kind, body)``: a ``Landed`` for LANDED, the slot for ACK, the tid for ABORT.

    Raises:
        ValueError: not a message of this protocol.
    """
    kind, _, rest = msg.partition(b" ")
    if kind == LANDED:
        first, count, slot, tid = rest.split(b" ", 3)
        return kind, Landed(tid, int(first), int(count), int(slot))
    if kind == ACK:
        return kind, int(rest)
    if kind == ABORT and rest:
        return kind, rest
    raise ValueError(f"not a KV transfer message: {msg[:64]!r}")
