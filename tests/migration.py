"""Streaming clients across a lost decode worker (request migration), shared by the colocated
(tests/gateway/replicas/test_migration.py) and the PD (tests/pd/test_migration.py) failover tests:
greedy chat streams through the official ``openai`` client, HF transformers fp32's greedy answers,
the gateway's ``pdserve:gateway_migrations_total``, and the decode workers' processes."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil

from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import SERVED_MODEL, Stack, children

MAX_TOKENS = 32
# greedy chats, each answered by HF once (``hf_answer``)
QUESTIONS = [f"Write a short story about the number {i}." for i in range(4)]
STREAMS = QUESTIONS * 4  # 16 streams, over both decode workers


def api(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, timeout=120)


def decode_worker(stack: Stack, index: int) -> psutil.Process:
    """The launcher's ``decode-{index}`` process (its port: internal base + 20 + index)."""
    return children(stack)[f"decode:{stack.internal_port_base + 20 + index}"]


def migrations(stack: Stack) -> dict[str, float]:
    """The gateway's migrations so far, by reason (stream_ended, worker_down, draining)."""
    values = stack.metrics(by=("reason",)).get("pdserve:gateway_migrations_total", {})
    return {reason: v for (reason,), v in values.items()}


def wait_healthy(stack: Stack, timeout: float = 180.0) -> None:
    """Until the gateway's /health answers 200 (every worker SERVING); AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{stack.base_url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, httpx.get(f"{stack.base_url}/health", timeout=10).text
        time.sleep(0.5)


@functools.cache
def hf_answer(question: str) -> str:
    """HF transformers fp32's greedy answer to ``question`` (a one-turn chat), ``MAX_TOKENS`` long."""
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


def run_streams(stack: Stack, questions: list[str], signal_worker: Callable[[], object]) -> list[str]:
    """Stream every question at once; once each has its first piece, call ``signal_worker()``.
    Returns the texts (a client error is raised here)."""
    client = api(stack)
    started = threading.Barrier(len(questions) + 1)
    with ThreadPoolExecutor(len(questions)) as pool:
        streams = [pool.submit(chat_text, client, started, q) for q in questions]
        started.wait(timeout=120)
        signal_worker()
        return [s.result(timeout=180) for s in streams]


def check_streams_migrate(
    stack: Stack, questions: list[str], signal_worker: Callable[[], object], reason: str
) -> None:
    """``run_streams``: every text equals HF's greedy answer (no client error, nothing repeated or
    lost), and the gateway migrated at least one stream for ``reason``."""
    before = migrations(stack).get(reason, 0.0)
    texts = run_streams(stack, questions, signal_worker)
    assert texts == [hf_answer(q) for q in questions]
    assert migrations(stack).get(reason, 0.0) >= before + 1, migrations(stack)


def check_streams_migrate_off_a_hung_worker(stack: Stack, index: int) -> None:
    """``check_streams_migrate`` with ``STREAMS``, ``decode-{index}`` SIGSTOPped: the gateway's health
    probes take it out (~9 s) and its streams continue on the other decode worker. Then it is woken
    (SIGCONT; or restarted, if the launcher's liveness check killed it first), drops the outputs it
    still had, and is routed to again."""
    victim = decode_worker(stack, index)
    try:
        check_streams_migrate(stack, STREAMS, lambda: victim.send_signal(signal.SIGSTOP), "worker_down")
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.send_signal(signal.SIGCONT)
    wait_healthy(stack, 300)
