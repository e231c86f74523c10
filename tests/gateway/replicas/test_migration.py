"""Request migration (``--migration-limit``, default 3) on two colocated decode workers behind the
launcher's gateway: streams on a decode worker that hangs (SIGSTOP), dies (SIGKILL) or drains
(SIGTERM) go on, on the other one, from the tokens already sent, with no client error and no
duplicated or missing text: greedy outputs equal HF transformers fp32, a seeded sampled one equals
the same request run uninterrupted. The workers' KV pools are conserved afterwards (``two_decode``).

Runs last in this folder (the drained worker is still restarting when it ends)."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import openai

from tests.migration import (
    QUESTIONS,
    STREAMS,
    api,
    check_streams_migrate,
    check_streams_migrate_off_a_hung_worker,
    decode_worker,
    migrations,
    wait_healthy,
)
from tests.stack import SERVED_MODEL, wait_for_log


def stream_text(client: openai.OpenAI, started: threading.Barrier, **request) -> str:
    """The streamed text of one completion; waits at ``started`` once its first piece came."""
    text, first = "", True
    for chunk in client.completions.create(model=SERVED_MODEL, stream=True, **request):
        text += chunk.choices[0].text
        if first:
            first = False
            started.wait(timeout=120)
    return text


def test_a_seeded_stream_on_a_hung_decode_worker_migrates_and_equals_an_uninterrupted_run(two_decode):
    """Two identical seeded streams, one per worker (round robin); decode-0 is SIGSTOPped once both
    have their first piece. The health probes take it out, its stream continues on decode-1; both
    texts equal the same request run uninterrupted. Once SIGCONTed, the outputs it still had for the
    old rid are dropped (the text stays exact)."""
    client = api(two_decode)
    request = dict(
        prompt="Tell me a story about a dragon.",
        max_tokens=40,
        temperature=0.9,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    reference = client.completions.create(model=SERVED_MODEL, **request).choices[0].text
    before = migrations(two_decode).get("worker_down", 0.0)
    victim = decode_worker(two_decode, 0)
    started = threading.Barrier(3)
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream_text, client, started, **request) for _ in range(2)]
        started.wait(timeout=120)
        victim.send_signal(signal.SIGSTOP)
        try:
            texts = [s.result(timeout=120) for s in streams]
        finally:
            victim.send_signal(signal.SIGCONT)
    assert texts == [reference, reference]
    assert migrations(two_decode).get("worker_down", 0.0) >= before + 1
    wait_healthy(two_decode)


def test_16_greedy_streams_survive_a_hung_decode_worker(two_decode):
    """decode-1 is SIGSTOPped with 16 greedy chat streams over both workers: its streams continue on
    decode-0, each text HF's greedy one."""
    check_streams_migrate_off_a_hung_worker(two_decode, 1)


def test_16_greedy_streams_survive_a_killed_decode_worker(two_decode):
    """16 greedy chat streams over both workers; decode-0 is SIGKILLed once every stream has its
    first piece: every stream ends normally with HF's greedy text, the killed worker's streams having
    continued on decode-1. The launcher restarts decode-0 (waited for: the drain test needs it)."""
    victim = decode_worker(two_decode, 0)
    check_streams_migrate(two_decode, STREAMS, lambda: victim.send_signal(signal.SIGKILL), "stream_ended")
    wait_for_log(two_decode, "decode-0 is back (pid", 300)
    wait_healthy(two_decode)


def test_streams_on_a_draining_decode_worker_migrate_instead_of_waiting(two_decode):
    """decode-1 is SIGTERMed (scale-down) with streams on it: the gateway sees it draining and moves
    them to decode-0; every text equals HF's greedy one, and decode-1, left with nothing, exits."""
    victim = decode_worker(two_decode, 1)
    check_streams_migrate(two_decode, QUESTIONS * 2, lambda: victim.send_signal(signal.SIGTERM), "draining")
    victim.wait(timeout=60)
    wait_for_log(two_decode, f"decode-1 (pid {victim.pid}) exited with code 0")
