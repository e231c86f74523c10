"""Issue 21, PD: a prefill worker and a decode worker of two tensor-parallel ranks each (prefill rank
i writes its KV heads into decode rank i over NIXL) give HF's greedy tokens through chunked
prefill, radix hits, retraction and aborts, every rank's state compared after every step; a prefill
worker of another TP size is refused at the handshake with both sides' values named."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import pytest
import torch

from pdserve.kv_transfer import KVLayout, KVTransferAgent
from pdserve.rpc.server import wait_for_health
from pdserve.services.common.convert import kv_agent_info_to_pb
from pdserve.v1 import scheduler_pb2_grpc
from tests.stack import Stack, free_port_block, launch_stack
from tests.tp.helpers import (
    check_aborts,
    check_chunked_prefill_and_radix_hit,
    check_greedy_equals_hf,
    check_group,
    check_retraction,
    tp_state_checks,
)

FLAGS = ("--num-prefill", "1", "--num-decode", "1", "--tp-size", "2", "--dtype", "float32")
FLAGS += ("--max-total-tokens", "1024", "--chunked-prefill-size", "64")


@pytest.fixture(scope="module")
def tp_pd_stack() -> Stack:
    stack = launch_stack(*FLAGS, log_name="tp-pd")
    yield stack
    stack.stop()


@pytest.fixture
def tp_pd(tp_pd_stack: Stack) -> Stack:
    before = tp_state_checks(tp_pd_stack)
    yield tp_pd_stack
    check_group(tp_pd_stack, before)


def test_greedy_equals_hf(tp_pd):
    check_greedy_equals_hf(tp_pd)


def test_chunked_prefill_and_radix_hit(tp_pd):
    check_chunked_prefill_and_radix_hit(tp_pd)


def test_retraction(tp_pd):
    check_retraction(tp_pd, requests=6, new_tokens=160)


def test_aborted_streams(tp_pd):
    check_aborts(tp_pd)


def test_handshake_with_another_tp_size_fails_clearly(tmp_path):
    """A TP=1 decode worker's agent offered to a TP=2 prefill worker: refused, naming both sizes."""
    port = free_port_block(1)
    log = open(tmp_path / "prefill.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "prefill", "--port", str(port), "--dtype", "float32",
         "--tp-size", "2", "--max-total-tokens", "1024"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert asyncio.run(wait_for_health(f"127.0.0.1:{port}", 300)), (tmp_path / "prefill.log").read_text()
        layout = KVLayout(
            model="LlamaForCausalLM:30x576:vocab49152", dtype="float32", page_size=16,
            num_layers=30, num_kv_heads=3, head_dim=64,
        )  # fmt: skip
        agent = KVTransferAgent(f"test-decode-{time.time_ns()}", torch.zeros(30, 2, 4, 16, 3, 64), layout)

        async def exchange():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = scheduler_pb2_grpc.PrefillSchedulerStub(channel)
                await stub.ExchangeKVAgentInfo(kv_agent_info_to_pb(agent.local_info()), timeout=30)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(exchange())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "tp_size: decode 1, prefill 2" in err.value.details(), err.value.details()
        agent.close()
    finally:
        proc.terminate()
        proc.wait(30)
