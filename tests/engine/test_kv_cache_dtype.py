"""``--kv-cache-dtype bfloat16`` under a float32 model on CPU: half the pool's bytes, attention as a
bfloat16 model does it (queries rounded) through the C kernels and through SDPA; what else the
flag refuses."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner, resolve_kv_cache_dtype
from pdserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.driver import Driver

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_choices():
    assert resolve_kv_cache_dtype("auto", torch.float32, CPU) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, CUDA) == torch.bfloat16
    assert resolve_kv_cache_dtype("float32", torch.float32, CPU) == torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, CPU) == torch.bfloat16
    for choice, model, device in (("float32", torch.bfloat16, CPU), ("bfloat16", torch.float32, CUDA)):
        with pytest.raises(ValueError, match="--kv-cache-dtype"):
            resolve_kv_cache_dtype(choice, model, device)


def last_logprobs(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Greedy-decode ``prompts`` together for ``steps`` steps; each step's log-softmax rows."""
    out: list[torch.Tensor] = []
    compute = runner.model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        out.append(logits.float().log_softmax(-1))
        return logits

    runner.model.compute_logits = record
    driver = Driver(runner)
    seqs = [driver.add(p, SamplingParams(temperature=0.0)) for p in prompts]
    try:
        for _ in range(steps):
            driver.step([(s, None) for s in seqs])
    finally:
        driver.release(*seqs)
        del runner.model.compute_logits
    return out


@pytest.fixture(scope="module")
def runners(model_path):
    return {
        kv: ModelRunner(model_path, dtype="float32", max_total_tokens=2048, kv_cache_dtype=kv)
        for kv in ("auto", "bfloat16")
    }


def test_bfloat16_pool_under_float32_model_stays_close(runners, tokenizer, long_text):
    full, half = runners["auto"], runners["bfloat16"]
    assert full.kv_pool.dtype == torch.float32 and half.kv_pool.dtype == torch.bfloat16
    assert half.kv_pool.kv_data.nbytes * 2 == full.kv_pool.kv_data.nbytes
    ids = tokenizer(long_text)["input_ids"]
    prompts = [ids[:40], ids[100:217]]
    expected = last_logprobs(full, prompts, steps=6)
    for use_cpu_kernels in (True, False):  # the C kernels, then gather + SDPA over the same pool
        backend = half.attn_backend
        half.attn_backend = TorchNativeAttnBackend(half, use_cpu_kernels=use_cpu_kernels)
        try:
            got = last_logprobs(half, prompts, steps=6)
        finally:
            half.attn_backend = backend
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a.argmax(-1), b.argmax(-1))
            # bfloat16 K/V (2^-9 relative) move this model's log-probabilities by a few hundredths
            assert float((a - b).abs().max()) < 0.15
