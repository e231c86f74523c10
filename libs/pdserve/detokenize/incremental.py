"""Batched incremental detokenization: one BatchTokenIDOutput's worth of rids per step."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.detokenize.decode_status import DecodeOptions, DecodeStatus, TextDelta
from pdserve.tokenization import Tokenizer


@dataclass(frozen=True, slots=True)
class TokenStep:
    """New ids of one rid in one scheduling step.

    Attributes:
        options: set on the rid's first step (it opens the decode state), None afterwards.
        finish: the scheduler finished the rid (EOS, length, abort, error): flush and drop it.
    """

    rid: str
    token_ids: Sequence[int]
    finish: bool = False
    options: DecodeOptions | None = None


class IncrementalDetokenizer:
    """Holds a ``DecodeStatus`` per rid and turns batches of new ids into text deltas.

    Args:
        tokenizer: the model's tokenizer.
        finished_memory: how many recently finished rids to remember, so that ids the scheduler
            sent before it heard of a stop-string finish are ignored instead of reopening a state.

    Each step decodes the windows of all rids in one ``batch_decode`` call per option set (the
    batched detokenizer of SGLang's DetokenizerManager).
    """

    def __init__(self, tokenizer: Tokenizer, finished_memory: int = 65536) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, DecodeStatus] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._finished_memory = finished_memory

    @property
    def num_active(self) -> int:
        """Number of rids with a live decode state."""
        return len(self._states)

    def step(self, batch: Sequence[TokenStep]) -> list[TextDelta | None]:
        """Feed one step's ids; returns one delta per item, None for an item that was ignored.

        Ignored: ids of a finished rid, and ids of an unknown rid that carry no ``options``.

        Raises:
            ValueError: a rid appears twice in ``batch``, or an id is out of the vocabulary.
        """
        rids = [item.rid for item in batch]
        if len(set(rids)) != len(rids):
            raise ValueError("a rid appears more than once in one batch")
        live: list[tuple[int, DecodeStatus, bool]] = []
        for i, item in enumerate(batch):
            self.tokenizer.check_ids(item.token_ids)
            status = self._open(item)
            if status is not None:
                status.ids.extend(item.token_ids)
                live.append((i, status, item.finish))
        deltas: list[TextDelta | None] = [None] * len(batch)
        groups: dict[tuple[bool, bool], list[tuple[int, DecodeStatus, bool]]] = {}
        for entry in live:
            opts = entry[1].options
            groups.setdefault((opts.skip_special_tokens, opts.spaces_between_special_tokens), []).append(entry)
        for (skip, spaces), entries in groups.items():
            windows = [w for _, status, _ in entries for w in status.windows()]
            texts = self.tokenizer.batch_decode(windows, skip, spaces)
            for k, (i, status, finish) in enumerate(entries):
                delta = status.advance(texts[2 * k], texts[2 * k + 1], finish)
                if delta.finished:
                    self._close(status.rid)
                deltas[i] = delta
        return deltas

    def _open(self, item: TokenStep) -> DecodeStatus | None:
        status = self._states.get(item.rid)
        if status is None and item.options is not None and item.rid not in self._finished:
            status = self._states[item.rid] = DecodeStatus(item.rid, item.options)
        return status

    def _close(self, rid: str) -> None:
        del self._states[rid]
        self._finished[rid] = None
        if len(self._finished) > self._finished_memory:
            self._finished.popitem(last=False)
