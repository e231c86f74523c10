"""Choosing an attention backend by name."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from pdserve.layers.attention import ATTENTION_BACKENDS, resolve_attention_backend


def test_auto_is_torch_native_on_cpu_and_names_are_checked():
    assert resolve_attention_backend("auto", "cpu") == "torch_native"
    assert resolve_attention_backend("flashinfer", "cuda:0") == "flashinfer"
    expected_on_cuda = "flashinfer" if importlib.util.find_spec("flashinfer") else "torch_native"
    assert resolve_attention_backend("auto", "cuda") == expected_on_cuda
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_attention_backend("triton", "cpu")
    assert set(ATTENTION_BACKENDS) == {"torch_native", "flashinfer"}


def test_backends_import_lazily(runner):
    assert type(runner.attn_backend).__name__ == "TorchNativeAttnBackend"
    assert "pdserve.layers.attention.flashinfer_backend" not in sys.modules
