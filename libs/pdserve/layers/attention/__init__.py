"""Attention backends behind one interface, chosen by name; each is imported only when chosen."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from pdserve.layers.attention.base import AttentionBackend

ATTENTION_BACKENDS = {
    "torch_native": "pdserve.layers.attention.torch_native_backend:TorchNativeAttnBackend",
    "flashinfer": "pdserve.layers.attention.flashinfer_backend:FlashInferAttnBackend",
}


def resolve_attention_backend(name: str, device: str) -> str:
    """``auto`` → ``flashinfer`` on CUDA when the package is importable, else ``torch_native``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        on_cuda = str(device).startswith("cuda")
        return "flashinfer" if on_cuda and importlib.util.find_spec("flashinfer") else "torch_native"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose auto or one of {sorted(ATTENTION_BACKENDS)}"
        )
    return name


def create_attention_backend(name: str, runner: Any) -> AttentionBackend:
    """Instantiate backend ``name`` (or ``auto``) for a ``ModelRunner`` (its config, pools, device)."""
    module_name, class_name = ATTENTION_BACKENDS[resolve_attention_backend(name, str(runner.device))].split(
        ":"
    )
    return getattr(importlib.import_module(module_name), class_name)(runner)


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "create_attention_backend", "resolve_attention_backend"]
