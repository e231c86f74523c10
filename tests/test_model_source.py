"""``--model`` resolution: a GGUF's safetensors cache is named by the file's contents."""

from __future__ import annotations

import shutil

from pdserve.model_source import _content_key


def test_cache_key_follows_contents_not_location(tmp_path):
    """The same GGUF in two checkouts shares one converted cache; another file does not."""
    original = tmp_path / "a" / "model.gguf"
    original.parent.mkdir()
    original.write_bytes(bytes(range(256)) * 80_000)  # 20 MB: head and tail samples differ from the middle
    copy = tmp_path / "b" / "model.gguf"
    copy.parent.mkdir()
    shutil.copy(original, copy)
    assert _content_key(original) == _content_key(copy)
    data = bytearray(original.read_bytes())
    data[-1] ^= 1  # the last weight changed
    copy.write_bytes(data)
    assert _content_key(original) != _content_key(copy)
    copy.write_bytes(original.read_bytes()[:-1])  # truncated
    assert _content_key(original) != _content_key(copy)
