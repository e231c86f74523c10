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

    __slots__ = ("stops",)

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stops if s))

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
        """
        held = 0
        room = len(text) - start
        for stop in self.stops:
            for k in range(min(len(stop) - 1, room), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held
