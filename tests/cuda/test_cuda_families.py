"""The model families on a GPU (``make test-cuda``): each family's tiny checkpoint (``tests.families``)
in float32 on CUDA gives HF's greedy tokens on the same GPU (torch_native attention; experts one by
one), and in bfloat16 on FlashInfer (sliding windows and soft-capping as plan arguments; gpt-oss,
whose sinks FlashInfer is not given, on torch_native) with the MoE experts as grouped GEMMs, its
chosen tokens' logprobs are about as close to HF float32 as HF's own bfloat16 forward is."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.attention.flashinfer_backend import FlashInferAttnBackend
from pdserve.sampling.sampling_params import SamplingParams
from tests.cuda.test_cuda_engine import hf_logprobs
from tests.engine.driver import Driver
from tests.families import FAMILIES, hf_model, make_checkpoint

CUDA = torch.device("cuda")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    assert torch.cuda.is_available(), "tests/cuda need a CUDA GPU (run them with make test-cuda on one)"
    root = tmp_path_factory.mktemp("families")
    for name in FAMILIES:
        make_checkpoint(name, root / name)
    return root


def _prompts() -> list[list[int]]:
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    return [ids[:3], ids[3:43], ids[43:153]]


def _run(runner: ModelRunner, params: SamplingParams) -> list:
    driver = Driver(runner)
    seqs = [driver.add(p, params) for p in _prompts()]
    driver.step([(s, None) for s in seqs])
    while any(len(s.output_ids) < NEW_TOKENS for s in seqs):
        driver.step([(s, None) for s in seqs if len(s.output_ids) < NEW_TOKENS])
    driver.release(*seqs)
    return seqs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float32_on_cuda_matches_hf_greedy(family, checkpoints):
    path = checkpoints / family
    runner = ModelRunner(path, dtype="float32", attention_backend="torch_native", device="cuda", page_size=4,
                         max_total_tokens=4096)  # fmt: skip
    hf = hf_model(path).to(CUDA)
    for seq in _run(runner, SamplingParams(temperature=0.0)):
        with torch.no_grad():
            ids = torch.tensor([seq.prompt], device=CUDA)
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        assert seq.output_ids == ref[0, len(seq.prompt) :].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bfloat16_on_flashinfer_is_as_close_to_float32_as_hf_bfloat16(family, checkpoints):
    path = checkpoints / family
    backend = "torch_native" if family == "gpt_oss" else "flashinfer"
    runner = ModelRunner(path, dtype="bfloat16", attention_backend=backend, device="cuda", page_size=4,
                         max_total_tokens=4096)  # fmt: skip
    assert isinstance(runner.attn_backend, FlashInferAttnBackend) == (backend == "flashinfer")
    seqs = _run(runner, SamplingParams(temperature=0.0, return_logprob=True))
    ours = [torch.tensor(s.logprobs) for s in seqs]
    fp32, bf16 = (
        hf_logprobs(hf_model(path).to(dtype).to(CUDA), seqs) for dtype in (torch.float32, torch.bfloat16)
    )
    ours_error = max(float((a - b).abs().max()) for a, b in zip(ours, fp32, strict=True))
    hf_error = max(float((a - b).abs().max()) for a, b in zip(bf16, fp32, strict=True))
    print(f"{family}: max |logprob - HF fp32|: engine bf16 {ours_error:.4f}, HF bf16 {hf_error:.4f}")
    assert ours_error <= 2 * hf_error + 1e-2


def test_flashinfer_refuses_attention_sinks(checkpoints):
    with pytest.raises(NotImplementedError, match="attention sinks"):
        ModelRunner(checkpoints / "gpt_oss", dtype="bfloat16", attention_backend="flashinfer", device="cuda",
                    max_total_tokens=1024)  # fmt: skip
