"""Gateway replicas: one real backend (two colocated decode workers, started once for this folder and
stopped after it) behind two gateway replicas, the launcher's (round_robin) and a second
``pdserve gateway`` process (cache_aware).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.stack import Stack, free_port_block, launch_stack

PAGE_SIZE = 16


def start_gateway(backend: Stack, *flags: str, log_name: str, timeout: float = 60.0) -> Stack:
    """One more ``pdserve gateway`` replica over the workers of ``backend`` (all but its gateway).

    The worker addresses are the ones ``backend``'s gateway reports in its /health body. Returns the
    replica as a ``Stack`` (a process with an HTTP and a gRPC port) once its /health answers 200.

    Raises:
        RuntimeError: it did not become healthy within ``timeout`` seconds (the message holds its log).
    """
    roles = httpx.get(f"{backend.base_url}/health", timeout=10).json()["roles"]
    workers = [f"--{role}-addresses={','.join(addresses)}" for role, addresses in roles.items()]
    port = free_port_block(2)
    log_path = os.path.join(os.path.dirname(backend.log_path), f"{log_name}.log")
    cmd = [
        sys.executable, "-m", "pdserve.cli", "gateway",
        "--port", str(port), "--grpc-port", str(port + 1), *workers, *flags,
    ]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    gateway = Stack(proc, port, port + 1, backend.internal_port_base, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{gateway.base_url}/health", timeout=2).status_code == 200:
                return gateway
        time.sleep(0.2)
    gateway.stop()
    with open(log_path) as f:
        raise RuntimeError(f"gateway {' '.join(flags)} did not become healthy:\n{f.read()[-4000:]}")


@pytest.fixture(scope="package")
def two_decode_stack() -> Stack:
    """``pdserve launch --colocated --num-decode 2`` (fp32) whose own gateway routes round_robin, with
    LoRA enabled (adapters loaded at run time)."""
    stack = launch_stack(
        "--colocated", "--num-decode", "2", "--router-policy", "round_robin",
        "--dtype", "float32", "--max-total-tokens", "8192", "--page-size", str(PAGE_SIZE),
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        log_name="two-decode",
    )  # fmt: skip
    yield stack
    stack.stop()


@pytest.fixture(scope="package")
def cache_aware_gateway(two_decode_stack: Stack) -> Stack:
    """A second gateway replica over ``two_decode_stack``'s workers, routing cache_aware."""
    gateway = start_gateway(
        two_decode_stack, "--router-policy", "cache_aware", log_name="gateway-cache-aware"
    )
    yield gateway
    gateway.stop()


@pytest.fixture
def two_decode(two_decode_stack: Stack) -> Stack:
    """``two_decode_stack``; afterwards both decode workers must be idle with their KV pools conserved."""
    yield two_decode_stack
    two_decode_stack.check_kv_conservation()
