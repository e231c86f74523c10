"""Request migration (``--migration-limit``, default 3) on two colocated decode workers behind the
launcher's gateway: streams on a decode worker that hangs (SIGSTOP) or dies (SIGKILL) go on, on the
other one, from the tokens already sent, with no client error and no duplicated or missing text:
greedy outputs equal HF transformers fp32, a seeded sampled one equals the same request run
uninterrupted. The workers' KV pools are conserved afterwards (``two_decode``).

Runs last in this folder: the killed worker is restarted by the launcher meanwhile."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from tests.reference import chat_ids, hf_greedy, hf_tokenizer
from tests.stack import SERVED_MODEL, Stack, children, wait_for_log

STREAMS = 16
MAX_TOKENS = 24


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


def test_16_greedy_streams_survive_a_killed_decode_worker(two_decode):
    """16 greedy chat streams over both workers; decode-0 is SIGKILLed once every stream has its
    first piece: every stream ends normally with HF's greedy text, the killed worker's streams having
    continued on decode-1."""
    distinct = [f"Write a short sentence about the number {i}." for i in range(4)]  # HF runs once each
    tok = hf_tokenizer()
    answers = {
        q: tok.decode(
            hf_greedy(chat_ids([{"role": "user", "content": q}]), MAX_TOKENS), skip_special_tokens=True
        )
        for q in distinct
    }
    questions = [distinct[i % len(distinct)] for i in range(STREAMS)]
    expected = [answers[q] for q in questions]
    client = api(two_decode)
    before = sum(migrations(two_decode).values())
    victim = decode_0(two_decode)
    started = threading.Barrier(STREAMS + 1)

    def chat(question: str) -> str:
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

    with ThreadPoolExecutor(STREAMS) as pool:
        streams = [pool.submit(chat, q) for q in questions]
        started.wait(timeout=120)
        victim.send_signal(signal.SIGKILL)
        texts = [s.result(timeout=180) for s in streams]
    assert texts == expected
    assert sum(migrations(two_decode).values()) >= before + 1
    assert "migrates (" in wait_for_log(two_decode, "migrates (")
    wait_for_log(two_decode, "decode-0 is back (pid", 300)
    wait_healthy(two_decode)
