"""Engine fixtures: the real SmolLM2-135M in our ModelRunner and in HF transformers, loaded once for
this package (package scope: the 1.3 GB runner is freed before the stacks of later packages start)."""

from __future__ import annotations

import inspect

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.native import forced_variant, runnable_variants
from pdserve.model_source import resolve_model
from tests import reference


@pytest.fixture(params=runnable_variants())
def kernel_variant(request) -> str:
    """Each CPU kernel variant this machine can execute in turn (``pdserve.layers.native``): tests
    taking this fixture run every variant against the same references."""
    with forced_variant(request.param):
        yield request.param


@pytest.fixture(scope="package")
def model_path():
    torch.set_num_threads(1)  # the CI machine is shared: one thread avoids OpenMP spin-waits
    return resolve_model()


@pytest.fixture(scope="package")
def runner(model_path) -> ModelRunner:
    return ModelRunner(model_path, dtype="float32", attention_backend="torch_native", max_total_tokens=16384)


@pytest.fixture(scope="package")
def hf_model(model_path):
    return reference.hf_model()  # the one fp32 copy every package's reference shares


@pytest.fixture(scope="package")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="package")
def long_text() -> str:
    """A few thousand characters of stable English prose: the standard library's own docs."""
    import argparse
    import json
    import textwrap

    return "\n\n".join(inspect.getdoc(m) for m in (argparse, json, textwrap, inspect))
