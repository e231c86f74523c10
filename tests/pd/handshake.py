"""A prefill worker started alone, offered a decode agent it must refuse at the handshake."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import torch

from pdserve.kv_transfer import KVLayout, KVTransferAgent
from pdserve.rpc.server import wait_for_health
from pdserve.services.common.convert import kv_agent_info_to_pb
from pdserve.v1 import scheduler_pb2_grpc
from tests.stack import free_port_block

PAGE = 16


def refused_handshake(log_dir: Path, *prefill_flags: str, kv_heads: int = 3) -> grpc.aio.AioRpcError:
    """Start ``pdserve prefill --dtype float32 *prefill_flags`` and offer it the agent of a TP=1
    decode worker of SmolLM2 (fp32, pages of 16 tokens; of a model with ``kv_heads`` KV heads); the
    error its ``ExchangeKVAgentInfo`` answered. Raises AssertionError if it accepted."""
    port = free_port_block(1)
    log_path = log_dir / "prefill.log"
    log = open(log_path, "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "prefill", "--port", str(port), "--dtype", "float32",
         "--max-total-tokens", "4096", *prefill_flags],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert asyncio.run(wait_for_health(f"127.0.0.1:{port}", 300)), log_path.read_text()
        layout = KVLayout(
            model="LlamaForCausalLM:30x576:vocab49152", dtype="float32", page_size=PAGE,
            num_layers=30, num_kv_heads=kv_heads, head_dim=64, total_kv_heads=kv_heads,
        )  # fmt: skip
        pool = torch.zeros(4, 30, 2, PAGE, kv_heads, 64)
        agent = KVTransferAgent(f"test-decode-{time.time_ns()}", pool, layout)

        async def exchange():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = scheduler_pb2_grpc.PrefillSchedulerStub(channel)
                await stub.ExchangeKVAgentInfo(kv_agent_info_to_pb(agent.local_info()), timeout=30)

        try:
            asyncio.run(exchange())
        except grpc.aio.AioRpcError as e:
            return e
        finally:
            agent.close()
        raise AssertionError("the prefill worker accepted the decode agent")
    finally:
        proc.terminate()
        proc.wait(30)
