"""The KV tier in PD: a prefix the prefill worker's pool evicted to its tier is loaded back there and
shipped to a decode worker that never held it, whose greedy output equals HF transformers fp32's.
Runs on ``two_decode_pd`` (tests/pd/conftest.py: pools of 2048 tokens, a 128 MiB tier each)."""

from __future__ import annotations

import httpx

from tests.reference import hf_greedy, hf_tokenizer
from tests.stack import Stack

PAGE = 16
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x kv heads x head dim x fp32
POOL_TOKENS = 2048


def prompt(topic: str) -> list[int]:
    """About 335 tokens about ``topic``; no page shared with another topic's prompt."""
    return hf_tokenizer()(f"Notes on {topic}. " + f"This line is about {topic}, and only {topic}. " * 30)[
        "input_ids"
    ]


def generate(stack: Stack, input_ids: list[int], max_new_tokens: int = 8) -> list[int]:
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    resp = httpx.post(f"{stack.base_url}/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def prefill_value(stack: Stack, name: str) -> float:
    return sum(v for (role, _), v in stack.metrics().get(name, {}).items() if role == "prefill")


def decode_bytes(stack: Stack) -> float:
    values = stack.metrics().get("pdserve:kv_transfer_bytes_total", {})
    return sum(v for (role, _), v in values.items() if role == "decode")


def test_a_prefix_in_the_prefill_workers_tier_is_loaded_back_and_shipped(two_decode_pd):
    """The prompt about the sea goes first (decode worker A, round robin); then 8 other prompts (four
    to each decode worker), more than the prefill worker's pool holds, make it evict the least
    recent pages, the sea's first, to its tier. The sea's prompt again goes to decode worker B, which
    holds none of it: the prefill worker loads its full pages back from the tier instead of
    computing them, and writes every page into B."""
    sea = prompt("the sea")
    topics = ("mountains", "bread", "a violin", "copper", "the moon", "tulips", "rain", "chess")
    fillers = [prompt(t) for t in topics]
    assert sum(map(len, fillers)) > POOL_TOKENS
    expected = hf_greedy(sea, 8)
    assert generate(two_decode_pd, sea) == expected
    for ids in fillers:
        generate(two_decode_pd, ids, max_new_tokens=1)  # (their prompts' KV is what counts)
    assert prefill_value(two_decode_pd, "pdserve:kv_tier_pages_used") >= len(sea) // PAGE
    hits = prefill_value(two_decode_pd, "pdserve:kv_tier_hit_tokens_total")
    shipped = decode_bytes(two_decode_pd)
    assert generate(two_decode_pd, sea) == expected
    loaded = prefill_value(two_decode_pd, "pdserve:kv_tier_hit_tokens_total") - hits
    assert loaded == (len(sea) - 1) // PAGE * PAGE  # the full pages before the last token
    assert decode_bytes(two_decode_pd) - shipped >= len(sea) * BYTES_PER_TOKEN
