"""Batched incremental detokenization: one BatchTokenIDOutput's worth of rids per step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.detokenize.decode_status import REPLACEMENT_CHAR, DecodeOptions, DecodeStatus, TextDelta
from pdserve.tokenization import Tokenizer

MAX_CUT_IDS = 4  # ids a character cut between tokens spans at most (a UTF-8 character has 4 bytes)


@dataclass(frozen=True, slots=True)
class TokenStep:
    """New ids of one rid in one scheduling step.

    Attributes:
        options: set on the rid's first step only: it opens a fresh decode state for the rid.
        finish: the scheduler finished the rid (EOS, length, abort, error): flush and drop it.
        resumed: with ``options``, a migrated request's continuation: the output ids its client
            already has (their text was sent); the fresh state starts after them.
    """

    rid: str
    token_ids: Sequence[int]
    finish: bool = False
    options: DecodeOptions | None = None
    resumed: Sequence[int] = ()


class IncrementalDetokenizer:
    """Holds a ``DecodeStatus`` per rid and turns batches of new ids into text deltas.

    Args:
        tokenizer: the model's tokenizer.

    A state opens with a step that carries ``options`` and closes when a delta is ``finished``.
    Ids of a rid without a state are ignored: e.g. those the scheduler still sends after a stop
    string ended the rid, before its Abort lands (they carry no ``options``).

    Each step decodes the windows of all rids in one ``batch_decode`` call per option set (the
    batched detokenizer of SGLang's DetokenizerManager).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, DecodeStatus] = {}

    @property
    def num_active(self) -> int:
        """Number of rids with a live decode state."""
        return len(self._states)

    def step(self, batch: Sequence[TokenStep]) -> list[TextDelta | None]:
        """Feed one step's ids; returns one delta per item, None for an item that was ignored.

        Ignored (None): an item without ``options`` for a rid that has no state (finished or unknown).

        Raises:
            ValueError: a rid appears twice in ``batch``, or an id is out of the vocabulary; no
                state has changed then.
        """
        if len({item.rid for item in batch}) != len(batch):
            raise ValueError("a rid appears more than once in one batch")
        for item in batch:  # validate all before changing any state
            self.tokenizer.check_ids(item.token_ids)
            self.tokenizer.check_ids(item.resumed)
        live: list[tuple[int, DecodeStatus, bool]] = []
        for i, item in enumerate(batch):
            status = self._open(item)
            if status is not None:
                status.add_ids(item.token_ids)
                live.append((i, status, item.finish))
        deltas: list[TextDelta | None] = [None] * len(batch)
        groups: dict[tuple[bool, bool], list[tuple[int, DecodeStatus, bool]]] = {}
        for entry in live:
            opts = entry[1].options
            key = (opts.skip_special_tokens, opts.spaces_between_special_tokens)
            groups.setdefault(key, []).append(entry)
        for (skip, spaces), entries in groups.items():
            windows = [w for _, status, _ in entries for w in status.windows()]
            texts = self.tokenizer.batch_decode(windows, skip, spaces)
            for k, (i, status, finish) in enumerate(entries):
                delta = status.advance(texts[2 * k], texts[2 * k + 1], finish)
                if delta.finished:
                    del self._states[status.rid]
                deltas[i] = delta
        return deltas

    def discard(self, rids: Sequence[str]) -> None:
        """Drop the states of ``rids`` without decoding anything (their text has no one to go to)."""
        for rid in rids:
            self._states.pop(rid, None)

    def _open(self, item: TokenStep) -> DecodeStatus | None:
        if item.options is not None:
            status = self._states[item.rid] = DecodeStatus(item.rid, item.options)
            if item.resumed:
                self._resume(status, list(item.resumed))
        return self._states.get(item.rid)

    def _resume(self, status: DecodeStatus, resumed: list[int]) -> None:
        """Set ``status`` after a migrated request's ``resumed`` ids: their text up to the last id
        that ends no cut character is stable, the ids after it (at most ``MAX_CUT_IDS``) pending."""
        opts = status.options
        split = len(resumed)
        while True:
            text = self.tokenizer.batch_decode(
                [resumed[:split]], opts.skip_special_tokens, opts.spaces_between_special_tokens
            )[0]
            if not text.endswith(REPLACEMENT_CHAR) or split <= max(len(resumed) - MAX_CUT_IDS, 0):
                break
            split -= 1
        context = resumed[max(split - MAX_CUT_IDS, 0) : split]
        status.resume(text, context, resumed[split:], len(resumed))
