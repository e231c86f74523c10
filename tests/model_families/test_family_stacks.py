"""Issue 42 on the real stack: every family's tiny random checkpoint (``tests.families``, SmolLM2's
tokenizer) served by ``pdserve launch`` through the gateway, colocated on one rank and disaggregated
(PD) on two tensor-parallel ranks per scheduler (one KV head replicated on both where the family has
one; experts spread over the ranks with ``--enable-expert-parallel`` for the MoE families), and
Gemma 3 so (PD, TP=2) with its local layers' KV in a page pool of their own
(``--swa-full-tokens-ratio``: the prompt's full pages and its last window's local pages shipped, in
both page spaces, each rank its KV head): greedy tokens equal HF transformers fp32 for prompts
chunked by a small prefill budget and long enough that every sliding window slides several times, a
repeated prompt is a radix-cache hit with the same tokens, and every scheduler's KV pages (both page
spaces of an SWA pool) are conserved after each test."""

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
PD_TP2 = ("--num-prefill", "1", "--num-decode", "1", "--tp-size", "2")
MODES = {
    "colocated": ("--colocated",),
    "pd-tp2": PD_TP2,
    # the local layers' KV in a page pool of their own on both workers: full and local pages shipped
    "pd-tp2-swa": (*PD_TP2, "--swa-full-tokens-ratio", "0.25"),
}
STACKS = [(f, m) for f in SERVED for m in ("colocated", "pd-tp2")] + [("gemma3", "pd-tp2-swa")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("served")
    for name in SERVED:
        make_checkpoint(name, root / name, vocab_size=49152, tokenizer=resolve_model())
    return root


@pytest.fixture(scope="module", params=STACKS, ids=lambda p: f"{p[0]}-{p[1]}")
def served(request, checkpoints) -> tuple[str, Stack]:
    family, mode = request.param
    flags = [*MODES[mode], *COMMON, "--model", str(checkpoints / family)]
    if mode != "colocated" and FAMILIES[family].moe:
        flags.append("--enable-expert-parallel")
    stack = launch_stack(*flags, log_name=f"family-{family}-{mode}")
    yield family, stack, mode
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
    """HF's tokens; with an SWA pool in PD, the bytes shipped are the prompts' full pages and only
    the local pages of their last window (what the first decode step reads)."""
    hf = hf_model(checkpoints / served[0])
    before = sum(decode_values(stack, "pdserve:kv_transfer_bytes_total"))
    results = generate_all(stack, prompts, NEW_TOKENS)
    for prompt, result in zip(prompts, results, strict=True):
        assert result["output_ids"] == hf_greedy(hf, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    if served[2] == "pd-tp2-swa":
        shipped = sum(decode_values(stack, "pdserve:kv_transfer_bytes_total")) - before
        assert shipped == swa_transfer_bytes(hf.config, [len(p) for p in prompts])
        assert decode_values(stack, "pdserve:swa_pages_total")  # the decode worker has the local pool


def decode_values(stack: Stack, name: str) -> list[float]:
    return [v for k, v in stack.metrics().get(name, {}).items() if k[0] == "decode"]


def swa_transfer_bytes(config, prompt_lens: list[int]) -> int:
    """KV bytes of prompts of ``prompt_lens`` tokens (fp32, pages of 4) in an SWA pool: every page of
    the global layers, and of the local ones only the pages the query at the prompt's end reads
    (keys from ``len + 1 - window`` on)."""
    local = sum(t == "sliding_attention" for t in config.layer_types)
    layer_page = 2 * 4 * config.num_key_value_heads * config.head_dim * 4  # K and V, fp32
    total = 0
    for n in prompt_lens:
        pages, behind = -(-n // 4), max(0, (n + 1 - config.sliding_window) // 4)
        total += (
            pages * (len(config.layer_types) - local) * layer_page + (pages - behind) * local * layer_page
        )
    return total


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
