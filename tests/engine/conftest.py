"""Engine fixtures: the real SmolLM2-135M in our ModelRunner and in HF transformers, loaded once."""

from __future__ import annotations

import inspect

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.native import forced_variant, runnable_variants
from pdserve.model_source import resolve_model


@pytest.fixture(params=runnable_variants())
def kernel_variant(request) -> str:
    """Each CPU kernel variant this machine can execute in turn (``pdserve.layers.native``): tests
    taking this fixture run every variant against the same references."""
    with forced_variant(request.param):
        yield request.param


@pytest.fixture(scope="session")
def model_path():
    torch.set_num_threads(1)  # the CI machine is shared: one thread avoids OpenMP spin-waits
    return resolve_model()


@pytest.fixture(scope="session")
def runner(model_path) -> ModelRunner:
    return ModelRunner(model_path, dtype="float32", attention_backend="torch_native", max_total_tokens=16384)


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def long_text() -> str:
    """A few thousand characters of stable English prose: the standard library's own docs."""
    import argparse
    import json
    import textwrap

    return "\n\n".join(inspect.getdoc(m) for m in (argparse, json, textwrap, inspect))
