"""Greedy speculation with n-gram drafts on the real model: token for token the outputs of decoding
without it (and of HF transformers fp32), with the same logprobs and top logprobs, on prompts whose
answers copy from them (where drafts stand) and on ones where they do not."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.model_source import resolve_model
from pdserve.sampling.sampling_params import SamplingParams
from pdserve.speculative.ngram import NgramProposer
from tests.engine.driver import Driver
from tests.reference import chat_ids, hf_greedy

NEW_TOKENS = 40
PARAMS = SamplingParams(temperature=0.0, return_logprob=True, top_logprobs_num=3)


@pytest.fixture(scope="module", params=["float32", "float32+w4a8"])
def runner(request) -> tuple[ModelRunner, bool]:
    """(runner, bit-exact): float32 through MKL's GEMMs (logprobs within 1e-4), or quantized."""
    torch.set_num_threads(1)
    dtype, _, method = request.param.partition("+")
    return ModelRunner(
        resolve_model(), dtype=dtype, quantization=method or None, max_total_tokens=4096
    ), bool(method)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    passage = (
        "The lighthouse keeper climbed the stairs every evening at dusk, trimmed the wick, polished the "
        "great lens and watched the ships pass the rocks until morning."
    )
    code = "def area(width, height):\n    result = width * height\n    return result\n"
    return [
        chat_ids([{"role": "user", "content": f"Repeat this sentence exactly:\n\n{passage}"}]),
        chat_ids([{"role": "user", "content": f"Rename the function area to surface:\n\n{code}"}]),
        chat_ids([{"role": "user", "content": "Name three colors."}]),
    ]


def generate(runner: ModelRunner, prompts, proposer=None) -> tuple[list, list[int]]:
    """Per prompt (its first ``NEW_TOKENS`` ids, logprobs, top logprobs), and the drafts each kept."""
    driver = Driver(runner)
    seqs = [driver.add(p, PARAMS) for p in prompts]
    driver.step([(s, None) for s in seqs])
    accepted = [0] * len(seqs)
    while min(len(s.output_ids) for s in seqs) < NEW_TOKENS:
        if proposer is None:
            driver.step([(s, None) for s in seqs])
            continue
        for i, kept in enumerate(driver.speculate(seqs, proposer, 5)):
            accepted[i] += kept.num_accepted_drafts
    driver.release(*seqs)
    return [
        (s.output_ids[:NEW_TOKENS], s.logprobs[:NEW_TOKENS], s.top_logprobs[:NEW_TOKENS]) for s in seqs
    ], accepted


def test_greedy_ngram_speculation_changes_no_token(runner, prompts):
    runner, exact = runner
    plain, _ = generate(runner, prompts)
    spec, accepted = generate(runner, prompts, NgramProposer())
    assert [s[0] for s in spec] == [p[0] for p in plain]
    assert accepted[0] >= 20  # the repeated sentence: most drafts stand (27 of its 40 tokens here)
    for (_, lp, top), (_, plain_lp, plain_top) in zip(spec, plain, strict=True):
        if exact:
            assert lp == plain_lp and top == plain_top
        else:
            assert torch.allclose(torch.tensor(lp), torch.tensor(plain_lp), atol=1e-4, rtol=0)
            assert [[t for t, _ in row] for row in top] == [[t for t, _ in row] for row in plain_top]
    if not exact:  # and HF transformers' fp32 greedy decoding of the same weights
        for prompt, (ids, _, _) in zip(prompts, spec, strict=True):
            reference = hf_greedy(prompt, NEW_TOKENS)
            assert ids[: len(reference)] == reference
