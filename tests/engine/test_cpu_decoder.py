"""The fused step (``CpuDecoder``: every decoder layer in one C call) against the modules' own path on
the same quantized model: the same kernels in the same order, so the same logits, bit for bit,
through ragged prefills, decodes and mixed batches; a mixed batch whose decodes do not come last
keeps the modules' path."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.cpu_decoder import CpuDecoder
from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.driver import Driver


@pytest.fixture(
    scope="module",
    params=[
        "float32+int4_or_int8",
        "float32+w8a8_int8",
        "bfloat16+int8_weight_only",
        "bfloat16+w4a8",
        "float32+w4a8+bfloat16",  # a bfloat16 KV pool under float32 activations
    ],
)
def runner(request, model_path) -> ModelRunner:
    dtype, method, kv_dtype = (request.param + "+auto").split("+")[:3]
    return ModelRunner(
        model_path, dtype=dtype, max_total_tokens=4096, quantization=method, kv_cache_dtype=kv_dtype
    )


def step_logits(
    runner: ModelRunner, fused: bool, prompts: list[list[int]], steps: int, late: list[int] | None = None
) -> list[torch.Tensor]:
    """Prefill ``prompts`` together, then ``steps`` greedy steps in which ``late`` (if any) is prefilled
    at the first, in chunks of 7 tokens: its extends first, the others' decodes after them, then one
    step of decodes first and its last chunk after them; every step's logits."""
    model = runner.model.model
    decoder, model.cpu_decoder = model.cpu_decoder, model.cpu_decoder if fused else None
    logits: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: logits.append(compute(hidden)) or logits[-1]
    driver = Driver(runner)
    seqs = [driver.add(p, SamplingParams(temperature=0.0)) for p in prompts]
    extra = [] if late is None else [driver.add(late, SamplingParams(temperature=0.0))]
    try:
        driver.step([(s, None) for s in seqs])
        for _ in range(steps):
            decodes = [(s, None) for s in seqs]
            if extra and extra[0].num_computed < len(late) - 7:
                driver.step([(extra[0], 7), *decodes])
            elif extra and extra[0].num_computed < len(late):
                driver.step([*decodes, (extra[0], None)])  # decodes first: the fused path too
            else:
                driver.step(decodes + [(s, None) for s in extra])
    finally:
        driver.release(*seqs, *extra)
        model.cpu_decoder = decoder
        del runner.model.compute_logits
    return logits


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """One entry per ``CpuDecoder`` call."""
    calls: list[int] = []
    run = CpuDecoder.__call__
    monkeypatch.setattr(CpuDecoder, "__call__", lambda self, *args: calls.append(1) or run(self, *args))
    return calls


def test_prefill_and_decode_steps_equal_the_modules_path(runner, fused_calls):
    assert isinstance(runner.model.model.cpu_decoder, CpuDecoder)
    prompts = [list(range(100, 100 + n)) for n in (5, 17, 40)]  # ragged lengths, one past a page
    fused = step_logits(runner, True, prompts, steps=6)
    assert len(fused_calls) == 7  # the prefill and every decode step
    modules = step_logits(runner, False, prompts, steps=6)
    assert len(fused_calls) == 7
    for a, b in zip(fused, modules, strict=True):
        assert torch.equal(a, b)


def test_mixed_steps_equal_the_modules_path(runner, fused_calls):
    prompts = [list(range(100, 100 + n)) for n in (5, 40)]
    late = list(range(300, 330))  # 30 tokens: chunks of 7 in 4 mixed steps, its last 2 after decodes
    fused = step_logits(runner, True, prompts, steps=7, late=late)
    assert len(fused_calls) == 1 + 5 + 2  # the prefill, 5 mixed steps (decodes first in one), 2 decodes
    modules = step_logits(runner, False, prompts, steps=7, late=late)
    for a, b in zip(fused, modules, strict=True):
        assert torch.equal(a, b)


def test_unquantized_float32_keeps_the_modules_path(model_path):
    """float32 matmuls stay on MKL (the HF-exactness tests compare them), so no fused decoder."""
    runner = ModelRunner(model_path, dtype="float32", max_total_tokens=1024)
    assert runner.model.model.cpu_decoder is None
