"""Per-rid incremental decode state with surrogate/read offsets (the method of vLLM and SGLang).

Each step decodes two windows of ids: ``ids[surr:read]`` (already turned into text, kept as
context) and ``ids[surr:]``; the text the second adds beyond the first is new. It becomes stable
only when it does not end in U+FFFD, i.e. no multi-byte character is cut between tokens; until
then the ids stay pending. The context window makes decoders that depend on neighbours (leading
space handling of SentencePiece, byte-level pieces) give the same text as one decode of all ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.detokenize.stop_strings import StopStringMatcher

REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """How one request's ids become text (fixed for the request's life).

    Attributes:
        min_new_tokens: a stop string may end the request only once this many ids were generated:
            a match counts only if it ends in text decoded at a step after which the rid has at
            least ``min_new_tokens`` ids (it may start in earlier text). Text decoded at earlier
            steps is never searched for a match of its own, as vLLM checks stop strings only in
            the new text of steps whose output length is >= ``min_tokens``.
    """

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_new_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Text to send for one rid after one step.

    Attributes:
        text: new characters (may be empty while text is pending or held back).
        finished: the rid's decode state is gone: finished by the scheduler or by a stop string.
        matched_stop: the stop string that ended it, None otherwise.
    """

    rid: str
    text: str
    finished: bool
    matched_stop: str | None = None


@dataclass(slots=True)
class DecodeStatus:
    """Decode state of one rid; memory stays bounded by the pending window and held-back text.

    Attributes:
        ids: ids from the surrogate offset on (earlier ones are dropped once decoded).
        read_offset: index into ``ids`` of the first id whose text is not stable yet.
        unsent: stable text not sent yet (held back because it may start a stop string).
        num_ids: ids received so far (the rid's output length).
    """

    rid: str
    options: DecodeOptions
    stops: StopStringMatcher = field(init=False)
    ids: list[int] = field(default_factory=list)
    read_offset: int = 0
    unsent: str = ""
    num_ids: int = 0

    def __post_init__(self) -> None:
        self.stops = StopStringMatcher(self.options.stop)

    def add_ids(self, ids: Sequence[int]) -> None:
        """Take this step's new ids (decoded by the next ``advance``)."""
        self.ids.extend(ids)
        self.num_ids += len(ids)

    def windows(self) -> tuple[list[int], list[int]]:
        """The (surrogate, read) id windows to decode for this step."""
        return self.ids[: self.read_offset], self.ids

    def advance(self, surr_text: str, read_text: str, finish: bool) -> TextDelta:
        """Take this step's decoded windows and return what may be sent now.

        ``finish`` flushes everything pending (a cut character then shows as U+FFFD, as in a full
        decode). A stop string that completes in the text made stable by this step ends the rid,
        once the rid has ``min_new_tokens`` ids: its text is cut at the match (the stop kept only
        with ``include_stop_str_in_output``), and the rest of the text is dropped.
        """
        new_text = read_text[len(surr_text) :]
        old_len = len(self.unsent)  # searched at an earlier step, or never to be (min_new_tokens)
        if finish or (new_text and not new_text.endswith(REPLACEMENT_CHAR)):
            self.unsent += new_text
            self.ids = self.ids[self.read_offset :]
            self.read_offset = len(self.ids)
        match = None
        if self.num_ids >= self.options.min_new_tokens:
            match = self.stops.find(self.unsent, old_len)
        if match is not None:
            end = match.end if self.options.include_stop_str_in_output else match.start
            return TextDelta(self.rid, self.unsent[:end], True, match.stop)
        if finish:
            return TextDelta(self.rid, self.unsent, True)
        end = len(self.unsent) - self.stops.partial_len(self.unsent)
        text, self.unsent = self.unsent[:end], self.unsent[end:]
        return TextDelta(self.rid, text, False)

    def resume(self, text: str, context: Sequence[int], pending: Sequence[int], num_ids: int) -> None:
        """Start after the ``num_ids`` ids of a migrated request whose ``text`` (stable: it ends in no
        cut character) its client already has, as the state that sent it would be: ``context`` (the
        last stable ids) and ``pending`` (those after them, a cut character) in the windows, and the
        end of ``text`` that may start a stop string held back. Nothing is sent or searched for a
        stop string (the request would have ended at a match)."""
        self.ids = [*context, *pending]
        self.read_offset = len(context)
        self.num_ids = num_ids
        self.unsent = text[len(text) - self.stops.partial_len(text) :]
