"""Request migration in PD (1 prefill + 2 decode workers, KV over NIXL, ``--migration-limit`` 3 by
default): 16 greedy chat streams through the official ``openai`` client over both decode workers; one
decode worker dies (SIGKILL), hangs (SIGSTOP) or drains (SIGTERM) once every stream has its first
piece. Its streams go on, on the other decode worker, through the prefill worker again (prompt +
the output ids already sent; the prompt's pages from its radix cache or its KV tier): no client
error, and every text equals HF transformers fp32's greedy answer. Every KV pool left (the prefill
worker's, the decode workers') is conserved and idle afterwards (``two_decode_pd``, tests/pd/conftest.py).

The drain runs last: the drained worker is still restarting when the folder's stack stops."""

from __future__ import annotations

import signal

from tests.migration import (
    MAX_TOKENS,
    QUESTIONS,
    STREAMS,
    check_streams_migrate,
    check_streams_migrate_off_a_hung_worker,
    decode_worker,
    hf_answer,
    wait_healthy,
)
from tests.stack import wait_for_log


def test_16_greedy_streams_survive_a_killed_decode_worker(two_decode_pd):
    """decode-0 is SIGKILLed: its streams' output streams end, and each continues on decode-1. The
    launcher restarts decode-0 (waited for: the next tests need both). Its first request (of two
    chats, round robin) redoes the KV handshake, and the prefill worker replaces the dead process's
    NIXL peer with the new one (the agent's name is the same, its incarnation new)."""
    victim = decode_worker(two_decode_pd, 0)
    check_streams_migrate(two_decode_pd, STREAMS, lambda: victim.send_signal(signal.SIGKILL), "stream_ended")
    wait_for_log(two_decode_pd, "decode-0 is back (pid", 300)
    wait_healthy(two_decode_pd)
    assert [two_decode_pd.chat(q, MAX_TOKENS) for q in QUESTIONS[:2]] == [hf_answer(q) for q in QUESTIONS[:2]]
    agent = f"decode-127.0.0.1:{two_decode_pd.internal_port_base + 20}-rank0"
    wait_for_log(two_decode_pd, f"KV peer {agent!r} restarted: its new incarnation replaces the old one")


def test_16_greedy_streams_survive_a_hung_decode_worker(two_decode_pd):
    """decode-1 is SIGSTOPped; its streams continue on decode-0, through the prefill worker."""
    check_streams_migrate_off_a_hung_worker(two_decode_pd, 1)


def test_streams_on_a_draining_decode_worker_migrate_instead_of_waiting(two_decode_pd):
    """decode-0 is SIGTERMed (scale-down): the gateway sees it draining and moves its streams to
    decode-1; decode-0, left with nothing, exits."""
    victim = decode_worker(two_decode_pd, 0)
    check_streams_migrate(two_decode_pd, STREAMS, lambda: victim.send_signal(signal.SIGTERM), "draining")
    victim.wait(timeout=60)
    wait_for_log(two_decode_pd, f"decode-0 (pid {victim.pid}) exited with code 0")
