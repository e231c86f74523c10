"""Issue 40 (part 5) on the real stack: prefill and decode workers of different TP sizes, prefill
TP=2 -> decode TP=1 and prefill TP=1 -> decode TP=2 (``--prefill-tp-size`` / ``--decode-tp-size``),
serving a tiny random Llama checkpoint with 4 KV heads (SmolLM2's tokenizer), so that each side's
ranks hold 2 heads and KV moves in head slices over NIXL: greedy tokens equal HF transformers fp32
for prompts of one to many pages (chunked by a small prefill budget, streamed per chunk), the bytes
shipped are every page of every head exactly once, and both workers' pools are conserved after
each test. One stack at a time (module-scoped, stopped before the next starts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.model_source import resolve_model
from tests.families import Family, hf_greedy, hf_model, make_checkpoint
from tests.stack import Stack, launch_stack
from tests.tp.helpers import generate_all

LLAMA_4KV = Family("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=8, num_key_value_heads=4))
PAGE = 4
NEW_TOKENS = 16
COMMON = (
    "--num-prefill", "1", "--num-decode", "1", "--dtype", "float32", "--page-size", str(PAGE),
    "--max-total-tokens", "2048", "--chunked-prefill-size", "32",
)  # fmt: skip
SIZES = {"prefill2-decode1": ("2", "1"), "prefill1-decode2": ("1", "2")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama-4kv") / "llama"
    return make_checkpoint(LLAMA_4KV, path, vocab_size=49152, tokenizer=resolve_model())


@pytest.fixture(scope="module")
def hf(checkpoint):
    model = hf_model(checkpoint)
    yield model
    del model


@pytest.fixture(scope="module", params=sorted(SIZES))
def hetero(request, checkpoint) -> Stack:
    prefill_tp, decode_tp = SIZES[request.param]
    flags = [
        *COMMON,
        "--prefill-tp-size",
        prefill_tp,
        "--decode-tp-size",
        decode_tp,
        "--model",
        str(checkpoint),
    ]
    stack = launch_stack(*flags, log_name=f"hetero-tp-{request.param}")
    yield stack
    stack.stop()


@pytest.fixture
def stack(hetero: Stack) -> Stack:
    yield hetero
    hetero.check_kv_conservation()


def shipped_bytes(stack: Stack) -> float:
    """KV bytes the decode worker was sent (every prefill rank's writes)."""
    return sum(
        v for k, v in stack.metrics().get("pdserve:kv_transfer_bytes_total", {}).items() if k[0] == "decode"
    )


def test_greedy_equals_hf_and_every_head_ships_once(stack, hf):
    ids = torch.randint(0, 49152, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    prompts = [ids[:3], ids[3:40], ids[40:150]]  # one page, ten, 28 (four prefill chunks)
    before = shipped_bytes(stack)
    results = generate_all(stack, prompts, NEW_TOKENS)
    for prompt, result in zip(prompts, results, strict=True):
        assert result["output_ids"] == hf_greedy(hf, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    cfg = hf.config
    page_bytes = cfg.num_hidden_layers * 2 * PAGE * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32
    assert shipped_bytes(stack) - before == sum(-(-len(p) // PAGE) for p in prompts) * page_bytes
