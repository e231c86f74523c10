"""Issue 6: prefill/decode disaggregation over NIXL with two workers per side."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest
import torch

from pdserve.kv_transfer import KVLayout, KVTransferAgent
from pdserve.rpc.server import wait_for_health
from pdserve.services.common.convert import kv_agent_info_to_pb
from pdserve.v1 import scheduler_pb2_grpc
from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import free_port_block, launch_stack

PAGE = 16
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
    port = free_port_block(1)
    log = open(tmp_path / "prefill.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "prefill", "--port", str(port), "--dtype", "float32",
         "--page-size", "32", "--max-total-tokens", "4096"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert asyncio.run(wait_for_health(f"127.0.0.1:{port}", 300)), (tmp_path / "prefill.log").read_text()
        layout = KVLayout(
            model="LlamaForCausalLM:30x576:vocab49152", dtype="float32", page_size=PAGE,
            num_layers=30, num_kv_heads=3, head_dim=64,
        )  # fmt: skip
        agent = KVTransferAgent(f"test-decode-{time.time_ns()}", torch.zeros(30, 2, 4, PAGE, 3, 64), layout)

        async def exchange():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = scheduler_pb2_grpc.PrefillSchedulerStub(channel)
                await stub.ExchangeKVAgentInfo(kv_agent_info_to_pb(agent.local_info()), timeout=30)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(exchange())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (
            "page_size" in err.value.details() and "32" in err.value.details() and "16" in err.value.details()
        )
        agent.close()
    finally:
        proc.terminate()
        proc.wait(30)
