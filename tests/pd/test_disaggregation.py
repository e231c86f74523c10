"""Issue 6: prefill/decode disaggregation over NIXL with two workers per side."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import grpc
import httpx
import pytest

from pdserve.mem_cache.block_hash import block_hashes
from tests.kv_event_index import snapshot_blocks
from tests.pd.handshake import PAGE, refused_handshake
from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import launch_stack

BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x kv heads x head dim x fp32
PROMPTS = [
    "What is the capital of France?",
    "Name three animals that live in the ocean.",
    "Explain in one sentence what a computer does.",
    "Write a haiku about autumn leaves.",
]


def generate(base_url: str, input_ids: list[int], max_new_tokens: int = 24) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    resp = httpx.post(f"{base_url}/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def decode_bytes(stack) -> dict[tuple, float]:
    return {k: v for k, v in stack.metrics()["pdserve:kv_transfer_bytes_total"].items() if k[0] == "decode"}


def test_pd_equals_colocated_equals_hf(stack, colocated):
    for prompt in PROMPTS:
        ids = chat_ids([{"role": "user", "content": prompt}])
        expected = hf_greedy(ids, 24)
        assert generate(stack.base_url, ids)["output_ids"] == expected, prompt
        assert generate(colocated.base_url, ids)["output_ids"] == expected, prompt


def test_second_turn_transfers_only_the_new_pages(stack):
    system = "You are a meticulous assistant. " * 40  # a long first turn: ~280 tokens
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Give me a colour."}]
    ids1 = chat_ids(turn1)
    out1 = generate(stack.base_url, ids1, 16)
    answer = hf_tokenizer().decode(out1["output_ids"], skip_special_tokens=True)
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And a fruit?"}]
    ids2 = chat_ids(turn2)
    assert ids2[: len(ids1)] == ids1
    stack.wait_idle()
    before = decode_bytes(stack)
    out2 = generate(stack.base_url, ids2, 16)
    after = decode_bytes(stack)
    moved = sum(after.values()) - sum(before.values())
    assert [k for k in after if after[k] != before.get(k, 0)], "no decode worker received KV"
    # the decode worker already holds turn 1's full pages: only the pages after them cross the wire
    new_pages = -(-len(ids2) // PAGE) - len(ids1) // PAGE
    assert 0 < moved <= new_pages * PAGE * BYTES_PER_TOKEN
    assert moved < len(ids2) * BYTES_PER_TOKEN / 2
    assert out2["output_ids"] == hf_greedy(ids2, 16)


def test_every_pd_scheduler_publishes_the_blocks_it_caches(stack):
    """KV events in PD: a prefill worker and a decode worker each cache the prompt's pages, and a new
    subscriber's snapshot names them with the hashes computed from the token ids."""
    ids = hf_tokenizer()(" ".join(f"Fact {i}: caches publish their blocks." for i in range(8)))["input_ids"]
    generate(stack.base_url, ids, 4)
    stack.wait_idle()
    prompt = set(block_hashes(ids, PAGE))
    base = stack.internal_port_base
    for service, offset in (("PrefillScheduler", 10), ("DecodeScheduler", 20)):
        snapshots = [snapshot_blocks(f"127.0.0.1:{base + offset + i}", service) for i in range(2)]
        assert any(prompt <= blocks for blocks in snapshots), service


@pytest.fixture(scope="module")
def two_prefill_stack():
    stack = launch_stack(
        "--num-prefill", "2", "--num-decode", "1", "--dtype", "float32", "--max-total-tokens", "16384",
        "--router-policy", "round_robin", log_name="pd-kill",
    )  # fmt: skip
    yield stack
    stack.stop()


def _pid_of(pattern: str) -> int:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=True).stdout.split()
    return int(out[0])


def test_prefill_killed_mid_transfer_retries_or_fails_clearly(two_prefill_stack):
    stack = two_prefill_stack
    long_ids = chat_ids([{"role": "user", "content": "Summarize: " + "the cat sat on the mat. " * 200}])
    expected = hf_greedy(long_ids, 8)
    prefill_port = stack.internal_port_base + 10

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            body = {"input_ids": long_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
            tasks = [
                asyncio.create_task(client.post(f"{stack.base_url}/generate", json=body)) for _ in range(6)
            ]
            await asyncio.sleep(0.3)
            os.kill(_pid_of(f"pdserve.cli prefill .*--port {prefill_port}"), signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    for resp in results:
        body = resp.json()
        if resp.status_code == 200 and body["meta_info"]["finish_reason"]["type"] in ("stop", "length"):
            assert body["output_ids"] == expected
        else:  # a clear error naming the failed prefill, never a hang or garbage
            assert "prefill" in resp.text.lower(), resp.text
    assert any(r.status_code == 200 and r.json()["output_ids"] == expected for r in results)
    stack.check_kv_conservation()


def test_handshake_with_mismatched_page_size_fails_clearly(tmp_path):
    err = refused_handshake(tmp_path, "--page-size", "32")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "page_size" in err.details() and "32" in err.details() and "16" in err.details()
