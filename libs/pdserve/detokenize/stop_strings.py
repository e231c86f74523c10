"""Stop strings matched on generated text, with hold-back of text that may start one."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopMatch:
    """Stop string ``stop`` found at character offset ``start`` of the text searched."""

    start: int
    stop: str

    @property
    def end(self) -> int:
        return self.start + len(self.stop)


class StopStringMatcher:
    """Finds the first stop string to complete in a text, and how much of its tail may start one.

    Args:
        stops: the stop strings (empty strings and duplicates are dropped); any number at once.

    "First" means the match that ends earliest, ties going to the one that starts earliest: this is
    the first point at which a stream must stop, and it does not depend on how the text arrived in
    pieces nor on the order the stops were listed in.
    """

    __slots__ = ("_prefix_ends", "stops")

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        # per stop: last character -> lengths of the proper prefixes ending in it, longest first
        self._prefix_ends: list[dict[str, list[int]]] = []
        for stop in self.stops:
            ends: dict[str, list[int]] = {}
            for k in range(len(stop) - 1, 0, -1):
                ends.setdefault(stop[k - 1], []).append(k)
            self._prefix_ends.append(ends)

    def find(self, text: str, new_from: int = 0) -> StopMatch | None:
        """The first stop string to complete in ``text[new_from:]``, or None.

        A match must end in ``text[new_from:]`` but may start before it: ``text[:new_from]`` is text
        already searched, or never to be searched for a match of its own (see ``DecodeStatus``).
        """
        best: StopMatch | None = None
        for stop in self.stops:
            i = text.find(stop, max(0, new_from - len(stop) + 1))
            if i >= 0 and (best is None or (i + len(stop), i) < (best.end, best.start)):
                best = StopMatch(i, stop)
        return best

    def partial_len(self, text: str, start: int = 0) -> int:
        """Length of the longest tail of ``text[start:]`` that is a proper prefix of some stop string.

        Those characters must be held back: the next tokens may complete a stop string with them.
        Only prefixes that end in the text's last character are tried, so a step costs at most one
        comparison per character of the stop strings (``pdserve.sampling.bounds`` caps their total),
        and usually a few.
        """
        room = len(text) - start
        if room <= 0:
            return 0
        held = 0
        last = text[-1]
        for stop, ends in zip(self.stops, self._prefix_ends, strict=True):
            for k in ends.get(last, ()):
                if k <= held:
                    break
                if k <= room and text.endswith(stop[:k]):
                    held = k
                    break
        return held
