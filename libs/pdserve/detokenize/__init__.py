"""Incremental detokenization per rid: stable text deltas, no split UTF-8, stop strings trimmed."""

from pdserve.detokenize.decode_status import DecodeOptions, DecodeStatus, TextDelta
from pdserve.detokenize.incremental import IncrementalDetokenizer, TokenStep
from pdserve.detokenize.stop_strings import StopMatch, StopStringMatcher

__all__ = [
    "DecodeOptions",
    "DecodeStatus",
    "IncrementalDetokenizer",
    "StopMatch",
    "StopStringMatcher",
    "TextDelta",
    "TokenStep",
]
