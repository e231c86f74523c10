"""Chunked extend equals one extend; a MIXED batch equals its requests run apart; both decode paths agree."""

from __future__ import annotations

import torch

from pdserve.engine.forward_batch import ForwardMode
from pdserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.driver import Driver, Seq

GREEDY = SamplingParams(temperature=0.0, return_logprob=True)


def kv_of(runner, seq: Seq, n: int) -> torch.Tensor:
    """K and V of positions [0, n) of ``seq``, every layer: [n, layers, 2, Hkv, D]."""
    slots = runner.req_to_token_pool.req_to_token[seq.req_pool_idx, :n]
    page_size = runner.kv_pool.page_size
    return runner.kv_pool.kv_data[slots // page_size, :, :, slots % page_size]


def test_chunked_extend_equals_one_extend(runner, tokenizer, long_text):
    prompt = tokenizer(long_text)["input_ids"][:300]
    driver = Driver(runner)
    whole, chunked = driver.add(prompt, GREEDY), driver.add(prompt, GREEDY)
    driver.step([(whole, None)])
    for size in (120, 100):  # chunks of a prefill: no token is sampled until the last one
        driver.step([(chunked, size)])
        assert chunked.output_ids == []
    driver.step([(chunked, None)])
    assert chunked.output_ids == whole.output_ids
    assert abs(chunked.logprobs[0] - whole.logprobs[0]) < 1e-4
    assert torch.allclose(kv_of(runner, chunked, 300), kv_of(runner, whole, 300), atol=1e-4)
    for _ in range(6):
        driver.step([(whole, None), (chunked, None)])
    assert chunked.output_ids == whole.output_ids
    driver.release(whole, chunked)


def test_mixed_batch_equals_requests_run_apart(runner, tokenizer, long_text):
    ids = tokenizer(long_text)["input_ids"]
    driver = Driver(runner)
    decoding = [driver.add(ids[i * 50 : i * 50 + n], GREEDY) for i, n in enumerate((40, 90))]
    extending = [driver.add(ids[500 + i * 60 : 500 + i * 60 + n], GREEDY) for i, n in enumerate((70, 130))]
    twins = {id(s): driver.add(s.prompt, GREEDY) for s in decoding + extending}
    for seq in decoding:  # prefilled, one token out: the next step decodes
        driver.step([(seq, None)])
        driver.step([(twins[id(seq)], None)])
    for seq in extending[1:]:  # a cached prefix: the next step extends the rest of the prompt
        driver.step([(seq, 64)])
        driver.step([(twins[id(seq)], 64)])

    batch = [decoding[0], extending[0], decoding[1], extending[1]]
    result = driver.step([(s, None) for s in batch], mode=ForwardMode.MIXED)
    apart = [driver.step([(twins[id(s)], None)]) for s in batch]
    assert result.next_token_ids == [r.next_token_ids[0] for r in apart]
    for mixed_lp, alone in zip(result.next_token_logprobs, apart, strict=True):
        assert abs(mixed_lp - alone.next_token_logprobs[0]) < 1e-4
    driver.release(*batch, *twins.values())


def test_decode_kernel_matches_gather_sdpa_path(runner, tokenizer, long_text):
    kernel_backend = runner.attn_backend
    assert kernel_backend.decode_kernel is not None, "the CPU decode kernel did not build"
    sdpa_backend = TorchNativeAttnBackend(runner, use_cpu_kernels=False)
    ids = tokenizer(long_text)["input_ids"]
    driver = Driver(runner)
    prompts = [ids[i * 31 : i * 31 + n] for i, n in enumerate((5, 17, 64, 200))]
    seqs = [driver.add(p, GREEDY) for p in prompts]
    driver.step([(s, None) for s in seqs])
    try:
        for _ in range(4):
            runner.attn_backend = kernel_backend
            via_kernel = runner.forward_batch_generation(driver.prepare([(s, None) for s in seqs]))
            runner.attn_backend = sdpa_backend
            via_sdpa = driver.step([(s, None) for s in seqs])
            assert via_kernel.next_token_ids == via_sdpa.next_token_ids
            diff = torch.tensor(via_kernel.next_token_logprobs) - torch.tensor(via_sdpa.next_token_logprobs)
            assert diff.abs().max() < 1e-4
    finally:
        runner.attn_backend = kernel_backend
        driver.release(*seqs)


def test_extend_after_cached_prefix_runs_on_the_kernel_and_matches_sdpa(runner, tokenizer, long_text):
    """Extends after cached prefixes run as rows of the C attention kernel (a row per new token),
    reading the prefix in place; the result equals the gather + SDPA path's."""
    kernel_backend = runner.attn_backend
    sdpa_backend = TorchNativeAttnBackend(runner, use_cpu_kernels=False)
    ids = tokenizer(long_text)["input_ids"]
    driver = Driver(runner)
    prompts = [ids[i * 40 : i * 40 + n] for i, n in enumerate((300, 420, 257))]
    seqs = [driver.add(p, GREEDY) for p in prompts]
    twins = [driver.add(p, GREEDY) for p in prompts]
    for seq in seqs + twins:
        driver.step([(seq, len(seq.prompt) - 37)])  # all but the last 37 tokens: a cached prefix
    try:
        batch = driver.prepare([(s, None) for s in seqs])
        kernel_backend.init_forward_metadata(batch)
        rows = kernel_backend.kernel_rows
        assert rows.row_req.tolist() == [r for r in range(3) for _ in range(37)]
        assert rows.seq_lens.tolist() == [len(p) - 36 + i for p in prompts for i in range(37)]
        via_kernel = runner.forward_batch_generation(batch)
        runner.attn_backend = sdpa_backend
        via_sdpa = driver.step([(s, None) for s in twins])
    finally:
        runner.attn_backend = kernel_backend
    assert via_kernel.next_token_ids == via_sdpa.next_token_ids
    diff = torch.tensor(via_kernel.next_token_logprobs) - torch.tensor(via_sdpa.next_token_logprobs)
    assert diff.abs().max() < 1e-4
    driver.release(*seqs, *twins)
