"""A hostile ``lora_path`` (``/v1/load_lora_adapter``) is refused as ``LoraAdapterError`` (HTTP 400)
without blocking the scheduler thread: a FIFO or a device in place of a file, an oversized or
malformed ``adapter_config.json``. No model is needed: the checks run before any weight is read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pdserve.lora.adapter import MAX_CONFIG_BYTES, LoraAdapterError, load_adapter

SHAPES = {(0, "q_proj"): (8, 8)}


def _adapter_dir(root: Path, config: object) -> Path:
    root.mkdir()
    (root / "adapter_config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ([1, 2], "not a JSON object"),
        ({"r": "abc", "lora_alpha": 16}, "r must be an integer"),
        ({"r": 1e400, "lora_alpha": 16}, "r must be an integer"),
        ({"r": True, "lora_alpha": 16}, "r must be an integer"),
        ({"r": 4, "lora_alpha": "x"}, "lora_alpha must be a finite number"),
        ({"r": 4, "lora_alpha": float("inf")}, "lora_alpha must be a finite number"),
    ],
)
def test_malformed_config_is_refused(tmp_path, config, match):
    with pytest.raises(LoraAdapterError, match=match):
        load_adapter("x", _adapter_dir(tmp_path / "a", config), 16, SHAPES)


def test_fifo_device_and_oversized_files_are_refused_without_reading(tmp_path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "adapter_config.json")  # reading it would block until a writer comes
    with pytest.raises(LoraAdapterError, match="not a regular file"):
        load_adapter("x", fifo, 16, SHAPES)
    zero = tmp_path / "zero"
    zero.mkdir()
    (zero / "adapter_config.json").symlink_to("/dev/zero")  # reading it would never end
    with pytest.raises(LoraAdapterError, match="not a regular file"):
        load_adapter("x", zero, 16, SHAPES)
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_bytes(b" " * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(LoraAdapterError, match="over"):
        load_adapter("x", big, 16, SHAPES)
    weights = _adapter_dir(tmp_path / "weights", {"r": 4, "lora_alpha": 8})
    os.mkfifo(weights / "adapter_model.safetensors")
    with pytest.raises(LoraAdapterError, match="not a regular file"):
        load_adapter("x", weights, 16, SHAPES)
