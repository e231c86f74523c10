"""A ragged batch extended together, then decoded together, equals HF transformers greedy generate()."""

from __future__ import annotations

import torch

from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.driver import Driver

PROMPT_LENS = [1, 7, 33, 100, 180, 300, 450, 600]
NEW_TOKENS = 48


def hf_greedy_with_logprobs(
    hf_model, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """HF greedy tokens (stopping at EOS) and the log-softmax of the raw logits at each chosen token."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=hf_model.config.eos_token_id,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def test_ragged_batch_matches_hf_greedy(runner, hf_model, tokenizer, long_text):
    text_ids = tokenizer(long_text)["input_ids"]
    prompts = [text_ids[7 * i : 7 * i + n] for i, n in enumerate(PROMPT_LENS)]
    assert [len(p) for p in prompts] == PROMPT_LENS
    driver = Driver(runner)
    seqs = [driver.add(p, SamplingParams(temperature=0.0, return_logprob=True)) for p in prompts]
    free_before = runner.token_to_kv_pool_allocator.available_size()
    driver.generate(seqs, NEW_TOKENS)
    assert all(len(s.output_ids) == NEW_TOKENS for s in seqs)
    used = sum(len(s.pages) for s in seqs)
    assert runner.token_to_kv_pool_allocator.available_size() == free_before - used
    driver.release(*seqs)
    for prompt, seq in zip(prompts, seqs, strict=True):
        ref_tokens, ref_logprobs = hf_greedy_with_logprobs(hf_model, prompt, NEW_TOKENS)
        n = len(ref_tokens)  # HF stops at EOS; the engine only samples
        assert seq.output_ids[:n] == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        assert torch.allclose(torch.tensor(seq.logprobs[:n]), torch.tensor(ref_logprobs), atol=1e-3, rtol=0)
