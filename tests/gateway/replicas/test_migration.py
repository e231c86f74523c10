"""Request migration (``--migration-limit``, default 3) on two colocated decode workers behind the
launcher's gateway: streams on a decode worker that hangs (SIGSTOP), dies (SIGKILL) or drains
(SIGTERM) go on, on the other one, from the tokens already sent, with no client error and no
duplicated or missing text: greedy outputs equal HF transformers fp32, a seeded sampled one equals
the same request run uninterrupted. The workers' KV pools are conserved afterwards (``two_decode``).

Runs last in this folder (the drained worker is still restarting when it ends)."""

from __future__ import annotations

import functools
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import SERVED_MODEL, Stack, children, wait_for_log

STREAMS = 16
MAX_TOKENS = 32
# greedy chats, each answered by HF once (``hf_answer``) for the SIGKILL and the drain test
QUESTIONS = [f"Write a short story about the number {i}." for i in range(4)]


def api(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, timeout=120)


def decode_0(stack: Stack):
    return children(stack)[f"decode:{stack.internal_port_base + 20}"]


def migrations(stack: Stack) -> dict[str, float]:
    values = stack.metrics(by=("reason",)).get("pdserve:gateway_migrations_total", {})
    return {reason: v for (reason,), v in values.items()}


def wait_healthy(stack: Stack, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{stack.base_url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, httpx.get(f"{stack.base_url}/health", timeout=10).text
        time.sleep(0.5)


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
    victim = decode_0(two_decode)
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


@functools.cache
def hf_answer(question: str) -> str:
    ids = hf_greedy(chat_ids([{"role": "user", "content": question}]), MAX_TOKENS)
    return hf_tokenizer().decode(ids, skip_special_tokens=True)


def chat_text(client: openai.OpenAI, started: threading.Barrier, question: str) -> str:
    """The streamed text of one greedy chat; waits at ``started`` once its first piece came."""
    text, first = "", True
    stream = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    for chunk in stream:
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        if first:
            first = False
            started.wait(timeout=120)
    return text


def run_streams(stack: Stack, questions: list[str], signal_worker) -> list[str]:
    """Stream every question at once; once each has its first piece, call ``signal_worker()``."""
    client = api(stack)
    started = threading.Barrier(len(questions) + 1)
    with ThreadPoolExecutor(len(questions)) as pool:
        streams = [pool.submit(chat_text, client, started, q) for q in questions]
        started.wait(timeout=120)
        signal_worker()
        return [s.result(timeout=180) for s in streams]


def test_16_greedy_streams_survive_a_killed_decode_worker(two_decode):
    """16 greedy chat streams over both workers; decode-0 is SIGKILLed once every stream has its
    first piece: every stream ends normally with HF's greedy text, the killed worker's streams having
    continued on decode-1. The launcher restarts decode-0 (waited for: the drain test needs it)."""
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(STREAMS)]
    before = migrations(two_decode).get("stream_ended", 0.0)
    victim = decode_0(two_decode)
    texts = run_streams(two_decode, questions, lambda: victim.send_signal(signal.SIGKILL))
    assert texts == [hf_answer(q) for q in questions]
    assert migrations(two_decode).get("stream_ended", 0.0) >= before + 1
    wait_for_log(two_decode, "decode-0 is back (pid", 300)
    wait_healthy(two_decode)


def test_streams_on_a_draining_decode_worker_migrate_instead_of_waiting(two_decode):
    """decode-1 is SIGTERMed (scale-down) with streams on it: the gateway sees it draining and moves
    them to decode-0; every text equals HF's greedy one, and decode-1, left with nothing, exits."""
    questions = QUESTIONS * 2
    before = migrations(two_decode).get("draining", 0.0)
    victim = children(two_decode)[f"decode:{two_decode.internal_port_base + 21}"]
    texts = run_streams(two_decode, questions, lambda: victim.send_signal(signal.SIGTERM))
    assert texts == [hf_answer(q) for q in questions]
    assert migrations(two_decode).get("draining", 0.0) >= before + 1
    victim.wait(timeout=60)
    wait_for_log(two_decode, f"decode-1 (pid {victim.pid}) exited with code 0")
