"""The verify forward mode (speculative decoding): a request's last token and ``k`` draft tokens in
one step, with logits at each, computes what ``k + 1`` decode steps over the same tokens compute.

Bit for bit where the matmuls are our per-row CPU kernels (quantized or bfloat16 models: a verify
token attends as a decode-kernel row); within the tolerance the engine's other float32 path tests use
(1e-4 on logprobs, ``test_chunked_and_mixed``) where MKL's float32 GEMM, whose blocking follows the
row count, or SDPA computes them. In a mixed batch too: a prompt's chunk, verifying requests and
plain decodes in one step, through the fused decoder where the model has one.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.forward_batch import ForwardMode
from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from pdserve.layers.cpu_decoder import CpuDecoder
from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.driver import Driver, Seq

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["float32", "float32-sdpa", "float32+w4a8", "bfloat16+w8a8_int8"])
def case(request, model_path) -> tuple[ModelRunner, bool]:
    """(runner, bit-exact expected): the engine's float32 runner (C attention kernels, or gather +
    SDPA), and quantized runners whose fused decoder runs every matmul per row."""
    if request.param.startswith("float32") and "+" not in request.param:
        runner = request.getfixturevalue("runner")
        if request.param == "float32":
            yield runner, False
            return
        kernels = runner.attn_backend
        runner.attn_backend = TorchNativeAttnBackend(runner, use_cpu_kernels=False)
        yield runner, False
        runner.attn_backend = kernels
        return
    dtype, method = request.param.split("+")
    runner = ModelRunner(model_path, dtype=dtype, quantization=method, max_total_tokens=4096)
    assert isinstance(runner.model.model.cpu_decoder, CpuDecoder)
    yield runner, True


def decode_logits(driver: Driver, seq: Seq, steps: int) -> torch.Tensor:
    """float32 ``[steps, V]``: the logits of ``steps`` greedy decode steps of ``seq`` alone."""
    rows = []
    for _ in range(steps):
        logits = driver.runner.forward_logits(driver.prepare([(seq, None)]))
        seq.num_computed += 1
        seq.output_ids.append(int(logits[0].float().argmax()))
        rows.append(logits[0].float())
    return torch.stack(rows)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(actual, expected)
    else:
        diff = (torch.log_softmax(actual, -1) - torch.log_softmax(expected, -1)).abs().max()
        assert diff < 1e-4, f"logprobs differ by {diff}"
        assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def test_verify_logits_equal_sequential_decodes(case, tokenizer, long_text):
    runner, exact = case
    ids = tokenizer(long_text)["input_ids"]
    driver = Driver(runner)
    prompts = [ids[i * 37 : i * 37 + n] for i, n in enumerate((5, 16, 40, 131))]  # one page, past pages
    ks = [6, 1, 8, 3]
    decoded = [driver.add(p, GREEDY) for p in prompts]
    verified = [driver.add(p, GREEDY) for p in prompts]
    driver.step([(s, None) for s in decoded])  # cached prefixes: prompts prefilled, one token out
    driver.step([(s, None) for s in verified])
    expected = [decode_logits(driver, seq, k + 1) for seq, k in zip(decoded, ks, strict=True)]
    work = [(v, d.output_ids[1 : k + 1]) for v, d, k in zip(verified, decoded, ks, strict=True)]
    fb, _ = driver.prepare_verify(work)
    assert fb.forward_mode is ForwardMode.TARGET_VERIFY
    assert fb.logits_lens.tolist() == [k + 1 for k in ks]
    logits = runner.forward_logits(fb).float()
    assert logits.shape[0] == sum(ks) + len(ks)
    for actual, want in zip(logits.split([k + 1 for k in ks]), expected, strict=True):
        assert_same(actual, want, exact)
    driver.release(*decoded, *verified)


def test_verify_rows_share_a_step_with_an_extend_and_decodes(case, tokenizer, long_text, monkeypatch):
    """[a prompt's last chunk, two verifying requests, a plain decode]: each row's logits as alone (the
    chunk's against the same chunk run on its own); through the fused decoder where the model has one."""
    runner, exact = case
    calls: list[int] = []
    fused = CpuDecoder.__call__
    monkeypatch.setattr(CpuDecoder, "__call__", lambda self, *a: calls.append(1) or fused(self, *a))
    ids = tokenizer(long_text)["input_ids"]
    driver = Driver(runner)
    prompts = [ids[300 + i * 50 : 300 + i * 50 + n] for i, n in enumerate((33, 18, 70))]
    ks = [4, 2, 0]
    twins = [driver.add(p, GREEDY) for p in prompts]
    seqs = [driver.add(p, GREEDY) for p in prompts]
    driver.step([(s, None) for s in twins + seqs])
    expected = [decode_logits(driver, twin, k + 1) for twin, k in zip(twins, ks, strict=True)]
    late, late_twin = driver.add(ids[:70], GREEDY), driver.add(ids[:70], GREEDY)
    driver.step([(late, 40)])  # its last 30 tokens run in the mixed step
    driver.step([(late_twin, 40)])
    late_alone = runner.forward_logits(driver.prepare([(late_twin, None)]))[0].float()
    drafts = [twin.output_ids[1 : k + 1] for twin, k in zip(twins, ks, strict=True)]
    fb, _ = driver.prepare_verify([(late, []), *zip(seqs, drafts, strict=True)])
    assert fb.forward_mode is ForwardMode.MIXED and fb.extend_seq_lens.tolist() == [30, 5, 3, 1]
    calls.clear()
    logits = runner.forward_logits(fb).float()
    assert len(calls) == (runner.model.model.cpu_decoder is not None)
    rows = logits.split([1] + [k + 1 for k in ks])
    assert_same(rows[0][0], late_alone, exact)
    for actual, want in zip(rows[1:], expected, strict=True):
        assert_same(actual, want, exact)
    driver.release(*twins, *seqs, late, late_twin)


def test_the_hidden_states_of_the_verified_positions_come_with_the_logits(runner, tokenizer, long_text):
    """What a draft head (EAGLE / MTP) would read: the final hidden state of every logits row, the
    very rows the LM head turned into the logits."""
    ids = tokenizer(long_text)["input_ids"]
    driver = Driver(runner)
    seqs = [driver.add(ids[:20], GREEDY), driver.add(ids[50:83], GREEDY)]
    driver.step([(s, None) for s in seqs])
    fb, _ = driver.prepare_verify([(seqs[0], ids[20:23]), (seqs[1], [])])
    hidden, logits = runner.forward_hidden_and_logits(fb)
    assert hidden.shape == (5, runner.model_config.hf_config.hidden_size)
    assert torch.equal(runner.model.compute_logits(hidden), logits)
    driver.release(*seqs)
