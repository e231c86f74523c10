"""Issue 42 on the real stack: every family's tiny random checkpoint (``tests.families``, SmolLM2's
tokenizer) served by ``pdserve launch`` through the gateway, colocated on one rank and disaggregated
(PD) on two tensor-parallel ranks per scheduler (one KV head replicated on both where the family has
one; experts spread over the ranks with ``--enable-expert-parallel`` for the MoE families): greedy
tokens equal HF transformers fp32 for prompts chunked by a small prefill budget and long enough that
every sliding window slides several times, a repeated prompt is a radix-cache hit with the same
tokens, and every scheduler's KV pages are conserved after each test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.model_source import resolve_model
from tests.families import FAMILIES, hf_greedy, hf_model, make_checkpoint
from tests.stack import Stack, launch_stack
from tests.tp.helpers import generate, generate_all

SERVED = ("mistral", "mixtral", "qwen3_moe", "gemma3", "gpt_oss")
NEW_TOKENS = 24
COMMON = (
    "--dtype",
    "float32",
    "--page-size",
    "4",
    "--max-total-tokens",
    "4096",
    "--chunked-prefill-size",
    "32",
)
MODES = {
    "colocated": ("--colocated",),
    "pd-tp2": ("--num-prefill", "1", "--num-decode", "1", "--tp-size", "2"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    for name in SERVED:
        make_checkpoint(name, root / name, vocab_size=49152, tokenizer=resolve_model())
    return root


@pytest.fixture(
    scope="module", params=[(f, m) for f in SERVED for m in MODES], ids=lambda p: f"{p[0]}-{p[1]}"
)
def served(request, checkpoints) -> tuple[str, Stack]:
    family, mode = request.param
    flags = [*MODES[mode], *COMMON, "--model", str(checkpoints / family)]
    if mode != "colocated" and FAMILIES[family].moe:
        flags.append("--enable-expert-parallel")
    stack = launch_stack(*flags, log_name=f"family-{family}-{mode}")
    yield family, stack
    stack.stop()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    ids = torch.randint(0, 49152, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    return [ids[:5], ids[5:45], ids[45:155]]  # the last: 110 tokens, four prefill chunks


@pytest.fixture
def stack(served) -> Stack:
    yield served[1]
    served[1].check_kv_conservation()


def test_greedy_equals_hf(served, stack, prompts, checkpoints):
    hf = hf_model(checkpoints / served[0])
    results = generate_all(stack, prompts, NEW_TOKENS)
    for prompt, result in zip(prompts, results, strict=True):
        assert result["output_ids"] == hf_greedy(hf, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"


def test_radix_hit_gives_the_same_tokens(served, stack, prompts, checkpoints):
    """The long prompt again: its pages come from the cache (all but the last partial page and
    the last token), past every window, and the tokens are the same."""
    long = prompts[-1] + [7, 8, 9]  # a fresh prompt this module has not served yet
    expected = hf_greedy(hf_model(checkpoints / served[0]), long, NEW_TOKENS)
    first = generate(stack, long, NEW_TOKENS)
    again = generate(stack, long, NEW_TOKENS)
    assert first["output_ids"] == expected
    assert again["output_ids"] == expected
    assert again["meta_info"]["cached_tokens"] >= (len(long) - 1) // 4 * 4 - 4
