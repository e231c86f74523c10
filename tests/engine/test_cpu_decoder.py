"""The fused decode step (``CpuDecoder``: every decoder layer in one C call) against the modules' own
path on the same quantized model: the same kernels in the same order, so the same logits, bit for
bit, through ragged batches of decodes; batches with extends keep the modules' path."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.cpu_decoder import CpuDecoder
from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.driver import Driver


@pytest.fixture(
    scope="module",
    params=["float32+int4_or_int8", "float32+w8a8_int8", "bfloat16+int8_weight_only", "bfloat16+w4a8"],
)
def runner(request, model_path) -> ModelRunner:
    dtype, _, method = request.param.partition("+")
    return ModelRunner(model_path, dtype=dtype, max_total_tokens=4096, quantization=method)


def decode_logits(
    runner: ModelRunner, fused: bool, prompts: list[list[int]], steps: int
) -> list[torch.Tensor]:
    """Prefill ``prompts`` together, then ``steps`` greedy decode steps; each step's logits."""
    model = runner.model.model
    decoder, model.cpu_decoder = model.cpu_decoder, model.cpu_decoder if fused else None
    logits: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda hidden: logits.append(compute(hidden)) or logits[-1]
    driver = Driver(runner)
    seqs = [driver.add(p, SamplingParams(temperature=0.0)) for p in prompts]
    try:
        for _ in range(steps + 1):
            driver.step([(s, None) for s in seqs])
    finally:
        driver.release(*seqs)
        model.cpu_decoder = decoder
        del runner.model.compute_logits
    return logits[1:]


def test_decode_steps_equal_the_modules_path(runner, monkeypatch):
    assert isinstance(runner.model.model.cpu_decoder, CpuDecoder)
    calls = []
    run = CpuDecoder.__call__
    monkeypatch.setattr(CpuDecoder, "__call__", lambda self, *args: calls.append(1) or run(self, *args))
    prompts = [list(range(100, 100 + n)) for n in (5, 17, 40)]  # ragged lengths, one past a page
    fused = decode_logits(runner, True, prompts, steps=6)
    assert len(calls) == 6  # every decode step, not the prefill
    modules = decode_logits(runner, False, prompts, steps=6)
    for a, b in zip(fused, modules, strict=True):
        assert torch.equal(a, b)


def test_unquantized_float32_keeps_the_modules_path(model_path):
    """float32 matmuls stay on MKL (the HF-exactness tests compare them), so no fused decoder."""
    runner = ModelRunner(model_path, dtype="float32", max_total_tokens=1024)
    assert runner.model.model.cpu_decoder is None
