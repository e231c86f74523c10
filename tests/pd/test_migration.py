"""Request migration in PD (1 prefill + 2 decode workers, KV over NIXL, ``--migration-limit`` 3 by
default): 16 greedy chat streams through the official ``openai`` client over both decode workers; one
decode worker dies (SIGKILL), hangs (SIGSTOP) or drains (SIGTERM) once every stream has its first
piece. Its streams go on, on the other decode worker, through the prefill worker again (prompt +
the output ids already sent; the prompt's pages from its radix cache): no client error, and every
text equals HF transformers fp32's greedy answer. Every KV pool left (the prefill worker's, the
decode workers') is conserved and idle afterwards."""

from __future__ import annotations

import contextlib
import signal

import psutil
import pytest

from tests.migration import STREAMS, check_streams_migrate, decode_worker, wait_healthy
from tests.stack import Stack, launch_stack, wait_for_log

FLAGS = (
    "--num-prefill", "1", "--num-decode", "2", "--router-policy", "round_robin",
    "--dtype", "float32", "--max-total-tokens", "8192",
)  # fmt: skip


@pytest.fixture(scope="module")
def pd_migration_stack() -> Stack:
    stack = launch_stack(*FLAGS, log_name="pd-migration")
    yield stack
    stack.stop()


@pytest.fixture
def stack(pd_migration_stack: Stack) -> Stack:
    """The stack; afterwards every scheduler is idle with its KV pool conserved."""
    yield pd_migration_stack
    pd_migration_stack.check_kv_conservation()


def test_16_greedy_streams_survive_a_killed_decode_worker(stack):
    """decode-0 is SIGKILLed: its streams' output streams end, and each continues on decode-1. The
    launcher restarts decode-0 (waited for: the next tests need both)."""
    victim = decode_worker(stack, 0)
    check_streams_migrate(stack, STREAMS, lambda: victim.send_signal(signal.SIGKILL), "stream_ended")
    wait_for_log(stack, "decode-0 is back (pid", 300)
    wait_healthy(stack)


def test_16_greedy_streams_survive_a_hung_decode_worker(stack):
    """decode-1 is SIGSTOPped: the gateway's health probes take it out (~9 s) and its streams continue
    on decode-0. Woken (SIGCONT; or restarted, if the launcher's liveness check killed it first), it
    drops the outputs it still had and is routed to again."""
    victim = decode_worker(stack, 1)
    try:
        check_streams_migrate(stack, STREAMS, lambda: victim.send_signal(signal.SIGSTOP), "worker_down")
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.send_signal(signal.SIGCONT)
    wait_healthy(stack, 300)


def test_streams_on_a_draining_decode_worker_migrate_instead_of_waiting(stack):
    """decode-0 is SIGTERMed (scale-down): the gateway sees it draining and moves its streams to
    decode-1; decode-0, left with nothing, exits."""
    victim = decode_worker(stack, 0)
    check_streams_migrate(stack, STREAMS, lambda: victim.send_signal(signal.SIGTERM), "draining")
    victim.wait(timeout=60)
    wait_for_log(stack, f"decode-0 (pid {victim.pid}) exited with code 0")
