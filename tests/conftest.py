"""Session-wide fixtures: the launched stacks (started once per test session) and the invariants."""

from __future__ import annotations

import gc

import pytest

from tests.stack import Stack, free_port_block, launch_stack

# fp32 so greedy outputs equal the HF reference; a modest KV pool per scheduler (16k tokens, 0.7 GiB in
# fp32); no chat-parser flags, as under `make run`: SmolLM2's tool calls are hermes (the default tool
# rendering), read from its chat template
COMMON = ("--dtype", "float32", "--max-total-tokens", "16384")


@pytest.fixture(scope="module", autouse=True)
def free_the_module_objects() -> None:
    """Collect cyclic garbage once a module's fixtures are torn down.

    A torn-down ``ModelRunner`` (weights and KV pool: 0.5-1 GB in fp32) sits in reference cycles that
    only a full collection frees, and among pytest's many live objects the generational collector
    seldom runs one: the runners of finished modules piled up to 10 GB in the test process, which
    beside the launched stacks took the suite to within 1 GB of a 24 GiB machine's memory.
    """
    yield
    gc.collect()


@pytest.fixture(scope="session")
def pd_stack() -> Stack:
    """2 prefill + 2 decode workers (KV over NIXL), fp32 so outputs match the HF reference exactly."""
    stack = launch_stack("--num-prefill", "2", "--num-decode", "2", *COMMON, log_name="pd")
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def colocated_stack() -> Stack:
    """One decode worker that prefills itself (mixed role), fp32; its KV events also in vLLM's ZMQ
    format, its PUB connecting to a consumer's SUB at ``extra["kv_events_zmq"]``, replay at + 1."""
    zmq_port = free_port_block(2)
    zmq_flags = ["--kv-events-endpoint", f"tcp://127.0.0.1:{zmq_port}"]
    zmq_flags += ["--kv-events-replay-endpoint", f"tcp://127.0.0.1:{zmq_port + 1}"]
    stack = launch_stack("--colocated", *COMMON, *zmq_flags, log_name="colocated")
    stack.extra["kv_events_zmq"] = zmq_port
    yield stack
    stack.stop()


@pytest.fixture
def stack(pd_stack: Stack) -> Stack:
    """The PD stack; after the test, every scheduler must be idle with its KV pool conserved."""
    yield pd_stack
    pd_stack.check_kv_conservation()


@pytest.fixture
def colocated(colocated_stack: Stack) -> Stack:
    yield colocated_stack
    colocated_stack.check_kv_conservation()
